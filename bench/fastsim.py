"""PR #187's plan on vllmsim's own engines and connectors, in one process, on a virtual clock.

A fit needs many trials; the full 4P4D benchmark (Envoy, sidecar, `vllm bench serve`, eight
simulator processes) takes minutes per trial on this machine and its CPU contention blurs the
cost model. Here the same `Engine`, `PullConnector` and `PushConnector` run in one event loop
whose clock jumps to the next timer (nothing else runs while a step "takes" its time), with the
side channel delivered in-process after its modelled latency. What this replaces of the real run:
the HTTP API (the engine's `api_path` is kept, and with it the API server's event loop and
tokenizer thread, which the engine's tokens go through too), the proxy (a fixed hop each way,
round robin over P and D as pd-extproc's default policy) and the client (`vllm bench serve`'s
plan: warm-ups, then 2 x C requests at concurrency C, TTFT at the client). A cell takes well under a
second of CPU, so a fit can try hundreds of profiles; bench/calibrate.py confirms with the real
processes.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid
from dataclasses import dataclass
from typing import Any

from bench.pr187 import MODES
from lab.clock import run_virtual
from lab.workloads import random_prompts
from vllmsim.config import CacheConfig, CostModel, Faults, KVTransferConfig
from vllmsim.engine import Engine, ErrorEvent, FinishEvent, KVMode, SimRequest, TokenEvent
from vllmsim.metrics import Metrics
from vllmsim.nixl import side_channel
from vllmsim.nixl.base import ConnectorBase
from vllmsim.nixl.params import Identity
from vllmsim.nixl.pull import PullConnector
from vllmsim.nixl.push import PushConnector

INPUT_LEN, OUTPUT_LEN = 1024, 64
WARMUPS = 8  # PR #187's --num-warmups
HOP_S = 0.0003  # one proxy hop (client -> proxy -> engine) on the PR's hosts: a Rust router


@dataclass
class _Engine:
    engine: Engine
    connector: ConnectorBase
    ident: Identity


class Cluster:
    """nP + nD engines of one connector kind, their side channels wired in-process."""

    def __init__(self, cost: CostModel, kind: str, n: int) -> None:
        self.cost = cost
        connector = "NixlPushConnector" if kind == "push" else "NixlConnector"
        self.engines: dict[int, _Engine] = {}
        self.prefill = [self._start(connector, "kv_producer") for _ in range(n)]
        self.decode = [self._start(connector, "kv_consumer") for _ in range(n)]
        self._tasks = [asyncio.get_running_loop().create_task(e.engine.run()) for e in self.all]

    @property
    def all(self) -> list[_Engine]:
        return [*self.prefill, *self.decode]

    def _start(self, connector: str, role: str) -> _Engine:
        port = len(self.engines) + 1
        engine_id = str(uuid.UUID(int=port))
        engine = Engine(self.cost, Metrics("sim", 0.0), engine_id, CacheConfig())
        ident = Identity(engine_id, "sim", port)
        cls = PushConnector if connector == "NixlPushConnector" else PullConnector
        conn = cls(engine, KVTransferConfig(connector, role), ident, Faults())
        engine.connector = conn
        self.engines[port] = _Engine(engine, conn, ident)
        return self.engines[port]

    async def side_request(
        self, host: str, port: int, msg: dict[str, Any], latency_s: float, **_: Any
    ) -> dict[str, Any]:
        """side_channel.request, delivered to the engine of that port: the wire's latency only."""
        if latency_s > 0:
            await asyncio.sleep(latency_s)
        return await self.engines[port].connector.handle(msg)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for e in self.all:
            await e.connector.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _serve(e: _Engine, req: SimRequest) -> tuple[float | None, dict[str, Any] | None]:
    """One request through the engine's API path: (time of the first token, final params)."""
    await e.engine.api_path(req.prompt_tokens)
    e.engine.submit(req)
    first = None
    while True:
        event = await req.events.get()
        if isinstance(event, TokenEvent) and first is None:
            first = asyncio.get_running_loop().time()
        elif isinstance(event, FinishEvent):
            return first, event.kv_transfer_params
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(event.message)


class Proxy:
    """pd-extproc's three dispatch modes, round robin over P and D."""

    def __init__(self, cluster: Cluster, mode: str) -> None:
        self.cluster, self.mode = cluster, mode
        self._p = self._d = 0

    def _pick(self) -> tuple[_Engine, _Engine]:
        c = self.cluster
        p, d = c.prefill[self._p % len(c.prefill)], c.decode[self._d % len(c.decode)]
        self._p, self._d = self._p + 1, self._d + 1
        return p, d

    async def ttft(self, rid: str, prompt: list[int]) -> float:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        p, d = self._pick()
        await asyncio.sleep(HOP_S)
        p_req = SimRequest(rid, prompt, 1, mode=KVMode.PREFILL)
        if self.mode == "push":  # both legs at once; D's params from P's known identity
            remote = {
                "remote_engine_id": p.ident.engine_id,
                "remote_host": p.ident.host,
                "remote_port": p.ident.port,
                "tp_size": 1,
                "remote_request_id": rid,
            }
            d_req = SimRequest(rid, prompt, OUTPUT_LEN, mode=KVMode.PUSH, remote=remote)
            _, (first, _) = await asyncio.gather(_serve(p, p_req), _serve(d, d_req))
        else:
            _, params = await _serve(p, p_req)
            await asyncio.sleep(2 * HOP_S)  # P's answer back to the proxy, the D leg out
            kind = KVMode.PULL if self.mode == "pull" else KVMode.PUSH
            d_req = SimRequest(rid, prompt, OUTPUT_LEN, mode=kind, remote=params)
            first, _ = await _serve(d, d_req)
        assert first is not None
        return first + HOP_S - sent


def prompts(seed: int, count: int) -> list[list[int]]:
    """`--dataset-name random --random-range-ratio 0`: `count` prompts of INPUT_LEN token ids."""
    return random_prompts(seed, count, INPUT_LEN)


async def _bench(proxy: Proxy, concurrency: int, batch: list[list[int]]) -> list[float]:
    """`vllm bench serve --max-concurrency C`: every request starts as soon as a slot frees."""
    slots, ttfts = asyncio.Semaphore(concurrency), []

    async def one(prompt: list[int]) -> None:
        async with slots:
            ttfts.append(await proxy.ttft(f"r-{uuid.uuid4().hex[:8]}", prompt))

    await asyncio.gather(*(one(p) for p in batch))
    return ttfts


async def _cell(
    cost: CostModel, mode: str, concurrency: int, runs: int, n: int, seed: int | None
) -> list[float]:
    """Mean TTFT (s) of each run; `seed`: every run's prompts from that seed (PR #187's
    `--seed 42`), None: each run its own (bench/client.py's 1000 + run)."""
    cluster = Cluster(cost, "pull" if mode == "pull" else "push", n)
    original = side_channel.request
    side_channel.request = cluster.side_request  # type: ignore[assignment]
    try:
        proxy = Proxy(cluster, mode)
        means = []
        for run in range(runs):
            batch = prompts(1000 + run if seed is None else seed, 2 * concurrency)
            # vllm bench serve's warm-ups, at C, send the first prompt: the engines they reach
            # cache it
            await _bench(proxy, concurrency, [batch[0]] * WARMUPS)
            means.append(statistics.fmean(await _bench(proxy, concurrency, batch)))
        return means
    finally:
        side_channel.request = original  # type: ignore[assignment]
        await cluster.close()


def mean_ttft_ms(
    cost: CostModel,
    mode: str,
    concurrency: int,
    runs: int = 4,
    n: int = 4,
    seed: int | None = None,
) -> float:
    """Best (lowest) mean TTFT of `runs` runs, in ms, as PR #187 reports its cells."""
    return 1e3 * min(run_virtual(lambda: _cell(cost, mode, concurrency, runs, n, seed)))


def table(
    cost: CostModel, concurrencies: tuple[int, ...], runs: int = 4, seed: int | None = None
) -> dict[int, dict[str, float]]:
    return {c: {m: mean_ttft_ms(cost, m, c, runs, seed=seed) for m in MODES} for c in concurrencies}


if __name__ == "__main__":
    import sys

    from vllmsim.profiles import PROFILES

    profile = PROFILES[sys.argv[1] if len(sys.argv) > 1 else "gpu-8b"]
    same = int(sys.argv[2]) if len(sys.argv) > 2 else None
    for c, row in table(profile, (1, 8, 32, 128), seed=same).items():
        print(c, {m: round(v, 1) for m, v in row.items()})
