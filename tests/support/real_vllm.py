"""Real vLLM CPU engines for the `real_vllm` tests: the one live P/D pair (`EnginePool`), a
sidecar in front of it (`sidecar_for`) and what the engines' metrics say."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from extproc.testing import SidecarHandle, ephemeral_config, running_sidecar, scrape
from scripts.real_vllm import (
    EngineNotHealthy,
    EngineSpec,
    RealEngine,
    pair_specs,
    start_engine,
    stop_engine,
    wait_healthy,
)

# Short leases so that "no expired lease" can be checked within a test, and a D request that
# waits for a push registration that never comes gives up in a minute, not eight.
KV_EXTRA: dict[str, object] = {"kv_lease_duration": 10, "decoder_kv_blocks_ttl": 60}
LEASE_S = 10
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


def specs_for(kind: str) -> tuple[EngineSpec, EngineSpec]:
    if kind.startswith("pull"):
        return pair_specs("pull", extra_kv_config=KV_EXTRA)
    if kind == "push_dp":  # P with two data-parallel ranks (one per core), the push kinds' D
        prefill, decode = specs_for("push")
        return replace(prefill, kv_events=False, data_parallel_size=2), decode
    # Push engines publish KV events (test_kv_events_real); answers are unchanged by it (prefix
    # caching is vLLM's default already), so every push kind shares that pair.
    return pair_specs(
        "push",
        decode_connector=kind != "push_plain_decode",
        extra_kv_config=KV_EXTRA,
        kv_events=True,
    )


class EnginePool:
    """The one live P/D pair; `get(kind)` swaps only engines whose spec differs."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.engines: dict[str, RealEngine] = {}
        self.start_times: list[tuple[str, float]] = []

    async def get(self, kind: str) -> tuple[RealEngine, RealEngine]:
        wanted = dict(zip(("P", "D"), specs_for(kind), strict=True))
        stale = [r for r, e in self.engines.items() if e.spec != wanted[r]]
        for role in stale:
            await asyncio.to_thread(stop_engine, self.engines.pop(role))
        missing = [r for r in ("P", "D") if r not in self.engines]
        if missing:
            await self._start(kind, [wanted[r] for r in missing])
        return self.engines["P"], self.engines["D"]

    async def _start(self, kind: str, specs: list[EngineSpec]) -> None:
        started = time.monotonic()
        fresh = [start_engine(spec, self.log_dir) for spec in specs]
        for engine in fresh:
            self.engines[engine.spec.role] = engine  # registered first: stopped even on failure
        for engine in fresh:
            await self._wait_or_restart(engine)
        roles = "+".join(s.role for s in specs)
        self.start_times.append((f"{kind} {roles}", time.monotonic() - started))

    async def _wait_or_restart(self, engine: RealEngine) -> None:
        """Wait for the engine; one that runs but never answers is started once more on fresh
        ports (seen once in CI: a pull P logged start-up complete and then answered no probe),
        and the first failure is printed so that its cause stays on record."""
        try:
            await asyncio.to_thread(wait_healthy, engine)
        except EngineNotHealthy as error:
            print(f"real_vllm: starting {engine.spec.role} again after: {error}", flush=True)
            await asyncio.to_thread(stop_engine, engine)
            again = start_engine(engine.spec, self.log_dir)
            self.engines[engine.spec.role] = again
            await asyncio.to_thread(wait_healthy, again)

    async def drop(self, role: str) -> None:
        """Stop one engine (e.g. one a test killed); the next `get` starts it afresh."""
        if (engine := self.engines.pop(role, None)) is not None:
            await asyncio.to_thread(stop_engine, engine)

    async def close(self) -> None:
        for engine in self.engines.values():
            await asyncio.to_thread(stop_engine, engine)
        self.engines.clear()


@dataclass
class Setup:
    """A live pair with the sidecar in front of it, plus log offsets to check engine logs."""

    prefill: RealEngine
    decode: RealEngine
    sidecar: SidecarHandle
    session: aiohttp.ClientSession
    log_offsets: dict[str, int]
    expired_before: float = 0.0  # P's expired-lease counter when this setup began

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        async with self.session.post(self.sidecar.url + path, json=body) as response:
            return response.status, await response.read()

    def new_log(self, engine: RealEngine) -> str:
        return engine.log_text()[self.log_offsets.get(str(engine.log_path), 0) :]


@contextlib.asynccontextmanager
async def sidecar_for(
    pool: EnginePool,
    kind: str,
    session: aiohttp.ClientSession,
    pools: dict[str, dict[str, Any]] | None = None,
    **config: Any,
) -> AsyncIterator[Setup]:
    """The sidecar in front of the pair; `pools` replaces keys of its `prefill` and `decode`
    pools (other endpoints, a policy)."""
    prefill, decode = await pool.get(kind)
    offsets = {str(e.log_path): len(e.log_text()) for e in (prefill, decode)}
    cfg = ephemeral_config([prefill.address], [decode.address], **config)
    for role, keys in (pools or {}).items():
        cfg[role] = {**cfg[role], **keys}
    expired = counter(await engine_metrics(session, prefill), EXPIRED)
    async with running_sidecar(cfg, log_level="INFO") as sidecar:
        yield Setup(prefill, decode, sidecar, session, offsets, expired)


async def engine_metrics(session: aiohttp.ClientSession, engine: RealEngine) -> dict[str, float]:
    # a real engine's API server shares two cores with its engine cores and the other engine:
    # under a forward pass its /metrics answer has taken more than 5 s
    return await scrape(session, engine.url + "/metrics", timeout_s=60)


def by_source(metrics: dict[str, float]) -> dict[str, float]:
    """vllm:prompt_tokens_by_source_total summed per source."""
    totals: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith("vllm:prompt_tokens_by_source_total{"):
            source = key.split('source="', 1)[1].split('"', 1)[0]
            totals[source] = totals.get(source, 0.0) + value
    return totals


def counter(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
