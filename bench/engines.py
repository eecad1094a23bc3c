"""The simulated engines of one topology (nPnD, push or pull connectors), started together.

Every engine gets the client's tokenizer and served name, so the simulator counts exactly the
tokens `vllm bench serve` counts (the client replaces its prompt lengths by the server's usage).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.procs import pinned
from vllmsim.launcher import PULL_D, PULL_P, PUSH_D, PUSH_P, EngineHandle, running_engine

CONNECTORS = {"push": (PUSH_P, PUSH_D), "pull": (PULL_P, PULL_D)}
# Near-instant steps: what is measured is the proxy, not the model.
INSTANT = (
    "--step-base-ms",
    "1",
    "--prefill-per-token-ms",
    "0.001",
    "--decode-per-seq-ms",
    "0",
    "--api-overhead-ms",
    "0",
)


@dataclass(frozen=True)
class Engines:
    kind: str
    prefill: list[EngineHandle]
    decode: list[EngineHandle]

    def addresses(self, role: str) -> list[str]:
        handles = self.prefill if role == "prefill" else self.decode
        return [f"127.0.0.1:{h.port}" for h in handles]

    @property
    def all(self) -> list[EngineHandle]:
        return [*self.prefill, *self.decode]


@contextlib.asynccontextmanager
async def running_engines(
    kind: str,
    n_prefill: int,
    n_decode: int,
    model: str,
    tokenizer: Path | None,
    cost_flags: Sequence[str] = (),
    cpus: set[int] | None = None,
    own_flags: Callable[[str, int], Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Engines]:
    """`own_flags(role, index)`: flags of one engine (its KV events' ports); `env`: the
    engines' environment additions."""
    p_cfg, d_cfg = CONNECTORS[kind]
    common = ["--served-model-name", model, "--log-level", "warning", *cost_flags]
    if tokenizer is not None:
        common += ["--tokenizer", str(tokenizer)]
    mine = own_flags or (lambda role, index: ())
    async with contextlib.AsyncExitStack() as stack:
        with pinned(cpus):
            prefill = [
                await stack.enter_async_context(_engine(p_cfg, [*common, *mine("prefill", i)], env))
                for i in range(n_prefill)
            ]
            decode = [
                await stack.enter_async_context(_engine(d_cfg, [*common, *mine("decode", i)], env))
                for i in range(n_decode)
            ]
        yield Engines(kind, prefill, decode)


def _engine(
    kv_config: str, flags: list[str], env: Mapping[str, str] | None
) -> contextlib.AbstractAsyncContextManager:
    return running_engine("--kv-transfer-config", kv_config, *flags, env=env, start_timeout=30)


async def sim_requests(http: aiohttp.ClientSession, engine: EngineHandle) -> list[dict]:
    """What one engine received (x_request_id, received_at, kv), from GET /sim/requests."""
    async with http.get(engine.url + "/sim/requests") as resp:
        resp.raise_for_status()
        return list(await resp.json())


async def clear_sim_requests(http: aiohttp.ClientSession, engines: Engines) -> None:
    """Forget recorded requests, so each measurement reads only its own (and memory stays flat)."""
    for engine in engines.all:
        async with http.delete(engine.url + "/sim/requests") as resp:
            resp.raise_for_status()


DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # the engines' env for POST /reset_prefix_cache


async def reset_prefix_caches(http: aiohttp.ClientSession, engines: Sequence[Engines]) -> None:
    """Every engine forgets its cached prompts (started with DEV_MODE), so that a run finds
    none of the prompts an earlier run, or another configuration on the same engines, left."""
    for handle in (h for group in engines for h in group.all):
        async with http.post(handle.url + "/reset_prefix_cache") as resp:
            resp.raise_for_status()


async def step_lateness(http: aiohttp.ClientSession, engines: Sequence[Engines]) -> dict:
    """The engines' step lateness so far (GET /sim/state), summed: steps, planned and late
    seconds, steps per lateness bucket (ms)."""
    total: dict = {"steps": 0, "planned_s": 0.0, "late_s": 0.0, "buckets_ms": {}}
    for handle in (h for group in engines for h in group.all):
        async with http.get(handle.url + "/sim/state") as resp:
            resp.raise_for_status()
            one = (await resp.json())["step_lateness"]
        for key in ("steps", "planned_s", "late_s"):
            total[key] += one[key]
        for le, n in one["buckets_ms"].items():
            total["buckets_ms"][le] = total["buckets_ms"].get(le, 0) + n
    return total


def lateness_delta(after: dict, before: dict) -> dict:
    """What a run added to the cumulative counters of `step_lateness`."""
    return {
        "steps": after["steps"] - before["steps"],
        "planned_s": round(after["planned_s"] - before["planned_s"], 6),
        "late_s": round(after["late_s"] - before["late_s"], 6),
        "buckets_ms": {
            le: n - before["buckets_ms"].get(le, 0) for le, n in after["buckets_ms"].items()
        },
    }
