"""One configuration's run: its config on the lab's cluster, the workload, the figures.

Each configuration gets a cluster of its own, fresh (empty caches, a clock from 0), and the
same workload; the policies that draw at random get generators seeded from the run's seed
(`lab.sidecar`), and Python's global `random` is seeded with it too, so that a run is a
function of its inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from extproc.config import Config, DispatchMode
from extproc.kvcache.routing import rank_engine
from extproc.process.workers import limits_share
from extproc.scheduling.shared_load import SharedLoad, table_bytes
from lab.clock import run_virtual
from lab.configs import lab_config, placeholder_tokenizer
from lab.diagnostics import write_requests
from lab.engines import MODEL, Cluster, EngineTotals, SimEngine, Topology
from lab.outcome import Outcome
from lab.sidecar import ProxyCosts, Sidecar
from lab.tokenizer import TokenizerCosts
from lab.workloads import LabRequest, Workload, prompt_text
from vllmsim.config import CostModel

__all__ = [
    "Progress",
    "Session",
    "Settings",
    "percentile",
    "run_config",
    "run_virtual_session",
    "session",
    "summarise",
]

T = TypeVar("T")

Progress = Callable[[str, float, int, int], None]  # config, simulated s, done, total


@dataclass(frozen=True)
class Settings:
    topology: Topology
    cost: CostModel
    costs: ProxyCosts = field(default_factory=ProxyCosts)
    seed: int = 1
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    workers: int = 1  # extproc.workers: ext_proc processes of one sidecar
    replicas: int = 1  # sidecars (each with its Envoy) the clients spread over
    prefill_kv_blocks: int | None = None  # every P's KV cache in blocks (None: the profile's)
    # closed loop: turn k of every chain as one run (C at a time, in a seeded shuffle), turn
    # k + 1 after all of turn k, as bench/cache.py's client sends conversations
    turn_waves: bool = False
    per_request: Path | None = None  # where each request's diagnostics go (lab.diagnostics)
    # prompts as text the sidecar tokenizes at these costs (lab.tokenizer); None: token ids
    tokenizer: TokenizerCosts | None = None


@dataclass
class _Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    started: float = 0.0


def run_config(
    path: Path, workload: Workload, settings: Settings, progress: Progress | None = None
) -> dict[str, Any]:
    """The summary of `workload` through the configuration in `path` (see `summarise`)."""
    return run_virtual_session(
        path, settings, lambda lab: _measure(lab, path.stem, workload, progress)
    )


def run_virtual_session(
    path: Path, settings: Settings, body: Callable[[Session], Awaitable[T]]
) -> T:
    """`body` on a fresh session of the configuration in `path`, on a virtual clock."""
    with tempfile.TemporaryDirectory(prefix="lab-tokenizer-") as folder:
        tokenizer = placeholder_tokenizer(Path(folder), words=settings.tokenizer is not None)

        async def main() -> T:
            async with session(path, tokenizer, settings) as lab:
                return await body(lab)

        return run_virtual(main)


async def _measure(
    lab: Session, name: str, workload: Workload, progress: Progress | None
) -> dict[str, Any]:
    lab.reset_totals()
    started = asyncio.get_running_loop().time()
    outcomes = await lab.drive(workload, _reporter(name, workload.requests, progress))
    summary = summarise(name, outcomes, lab.cluster, lab.settings, started)
    summary["workers"], summary["replicas"] = lab.settings.workers, lab.settings.replicas
    # what each scheduler's KV index learnt from the engines' events (nothing: not followed)
    summary["kv_index"] = lab.indexes()
    summary["kv_untokenized"] = lab.untokenized()
    if lab.settings.per_request is not None:
        p99 = summary["ttft_ms"]["p99"]
        write_requests(lab.settings.per_request, name, outcomes, p99)
    return summary


@dataclass
class Session:
    """A configuration's sidecars over a running cluster: workloads driven one after another
    share its engines' caches and the sidecars' state (warm-ups, then the measured phase)."""

    config: Config
    cluster: Cluster
    settings: Settings
    replicas: list[list[Sidecar]]

    @property
    def sidecars(self) -> list[Sidecar]:
        return [s for replica in self.replicas for s in replica]

    def reset_totals(self) -> None:
        """The engines' counts from here on (not the identity probes' or the warm-ups')."""
        for engine in self.cluster.all:
            engine.totals = EngineTotals()

    async def drive(
        self, workload: Workload, report: Callable[[int], None] | None = None
    ) -> list[Outcome]:
        """Each request's outcome, in the order they finished."""
        tally = _Tally()
        route = _router(self.replicas)
        header = self.config.dispatch.session_header
        report = report or (lambda done: None)
        if self.settings.turn_waves and not workload.open_loop:
            await _drive_waves(workload, route, header, tally, report, self.settings.seed)
        else:
            await _drive(workload, route, header, tally, report)
        return tally.outcomes

    def untokenized(self) -> dict[str, int]:
        """Requests routed without their token ids, by why (every sidecar's, since the
        session began: warm-ups too)."""
        counts: dict[str, int] = {}
        for sidecar in self.sidecars:
            for family in sidecar.metrics.kv_untokenized_requests.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        reason = sample.labels["reason"]
                        counts[reason] = counts.get(reason, 0) + int(sample.value)
        return counts

    def indexes(self) -> list[dict[str, Any]]:
        """What each ext_proc process's KV index holds: engines heard from, blocks."""
        found = []
        for sidecar in self.sidecars:
            index = sidecar.kv.index
            heard = [
                name
                for e in self.cluster.all
                for name, engine in _engine_names(e)
                if index.heard_from(engine)
            ]
            found.append({"engines_heard_from": heard, "blocks": index.blocks})
        return found


def _engine_names(server: SimEngine) -> list[tuple[str, str]]:
    """(output name, KV index key) of each engine of a server: its ranks', if it has ranks."""
    if len(server.ranks) == 1:
        return [(server.name, server.address)]
    return [
        (f"{server.name} dp{r.index}", rank_engine(server.address, r.index)) for r in server.ranks
    ]


@contextlib.asynccontextmanager
async def session(path: Path, tokenizer: Path, settings: Settings) -> AsyncIterator[Session]:
    """The configuration in `path` on a fresh cluster (empty caches), its sidecars started."""
    random.seed(settings.seed)
    names = Cluster.addresses(settings.topology)
    config = lab_config(path, names, tokenizer)
    transfer = "pull" if config.dispatch.mode is DispatchMode.PULL else "push"
    sidecars: list[Sidecar] = []
    loop = asyncio.get_running_loop()

    def deliver(address: str, rank: int, payload: bytes) -> None:  # ZMQ: the next loop turn
        for sidecar in sidecars:
            loop.call_soon(sidecar.kv_events, address, rank, payload)

    ranks = {role: getattr(config, role).data_parallel_size or 1 for role in names}
    prefill_cost = None
    if settings.prefill_kv_blocks is not None:
        prefill_cost = dataclasses.replace(settings.cost, num_gpu_blocks=settings.prefill_kv_blocks)
    cluster = Cluster(settings.topology, settings.cost, transfer, deliver, ranks, prefill_cost)
    try:
        with cluster.running():
            replicas = _replicas(config, cluster, settings)
            sidecars.extend(s for replica in replicas for s in replica)
            try:
                for sidecar in sidecars:
                    await sidecar.start()
                yield Session(config, cluster, settings, replicas)
            finally:
                for sidecar in sidecars:
                    await sidecar.stop()
    finally:
        await cluster.close()


def _replicas(config: Config, cluster: Cluster, settings: Settings) -> list[list[Sidecar]]:
    """Each replica's ext_proc processes, each with its own state; a replica's processes
    share its admission limits out as `extproc.workers` does (`limits_share`) and, unless
    `extproc.share_load` is off, count each other's load through one table, as `up`'s do."""
    share, workers = limits_share(config, settings.workers), settings.workers
    replicas = []
    for r in range(settings.replicas):
        sidecars = [
            Sidecar(
                share, cluster, settings.costs, settings.seed, r * workers + w, settings.tokenizer
            )
            for w in range(workers)
        ]
        if workers > 1 and config.extproc.share_load:  # `up`'s table, in this process
            table = bytearray(table_bytes(workers))
            clock = asyncio.get_running_loop().time
            for w, sidecar in enumerate(sidecars):
                sidecar.share_load(SharedLoad(table, workers, w, clock))
        replicas.append(sidecars)
    return replicas


def _router(replicas: list[list[Sidecar]]) -> Callable[[], Sidecar]:
    """Who takes the next request: the replicas in turn (a Service's spread), and within one
    the process with the fewest open streams, ties in turn (Envoy's LEAST_REQUEST over its
    ext_proc cluster, which compares two processes drawn at random: the same for two)."""
    turn = itertools.cycle(replicas)
    ties = itertools.count()

    def route() -> Sidecar:
        processes = next(turn)
        start = next(ties) % len(processes)
        ordered = processes[start:] + processes[:start]
        return min(ordered, key=lambda s: s.active_streams)

    return route


def _reporter(name: str, total: int, progress: Progress | None) -> Callable[[int], None]:
    """Progress at most every half second of wall time (it never changes the simulation)."""
    shown = [0.0]

    def report(done: int) -> None:
        now = time.monotonic()
        if progress is not None and (now - shown[0] >= 0.5 or done == total):
            shown[0] = now
            progress(name, asyncio.get_running_loop().time(), done, total)

    return report


async def _drive(
    workload: Workload,
    scheduler: Callable[[], Sidecar],
    session_header: str,
    tally: _Tally,
    report: Callable[[int], None],
) -> None:
    """`scheduler`: the one that takes the next request."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(request: LabRequest, chain: int, turn: int) -> None:
        await _one(scheduler, session_header, tally, request, chain, turn)
        report(len(tally.outcomes))

    async def chain_at(index: int) -> None:
        chain = workload.chains[index]
        await asyncio.sleep(max(0.0, start + chain.at - loop.time()))
        for turn, request in enumerate(chain.requests):
            await one(request, index, turn)

    if workload.open_loop:
        await asyncio.gather(*(chain_at(i) for i in range(len(workload.chains))))
        return
    queue = iter(enumerate(workload.chains))

    async def client() -> None:
        for index, chain in queue:  # each client takes the next chain when its own is done
            for turn, request in enumerate(chain.requests):
                await one(request, index, turn)

    await asyncio.gather(*(client() for _ in range(workload.concurrency)))


async def _drive_waves(
    workload: Workload,
    scheduler: Callable[[], Sidecar],
    session_header: str,
    tally: _Tally,
    report: Callable[[int], None],
    seed: int,
) -> None:
    """Closed loop by turns: turn k of every chain, C at a time, then turn k + 1."""
    rng = random.Random(f"lab-waves/{seed}")
    turns = max((len(c.requests) for c in workload.chains), default=0)
    for turn in range(turns):
        wave = [
            (i, c.requests[turn]) for i, c in enumerate(workload.chains) if turn < len(c.requests)
        ]
        rng.shuffle(wave)
        queue = iter(wave)

        async def client(queue: Iterator[tuple[int, LabRequest]], turn: int) -> None:
            for index, request in queue:
                await _one(scheduler, session_header, tally, request, index, turn)
                report(len(tally.outcomes))

        await asyncio.gather(*(client(queue, turn) for _ in range(workload.concurrency)))


async def _one(
    scheduler: Callable[[], Sidecar],
    session_header: str,
    tally: _Tally,
    request: LabRequest,
    chain: int,
    turn: int,
) -> None:
    """One request through the sidecar that takes it, labelled with its chain and turn."""
    headers = {session_header: request.session} if request.session else {}
    sidecar = scheduler()
    outcome = await sidecar.handle(_body(request, sidecar.text_prompts), headers)
    outcome.detail = {"chain": chain, "turn": turn, **(outcome.detail or {})}
    tally.outcomes.append(outcome)


def _body(request: LabRequest, text: bool) -> bytes:
    """What the client sends: the prompt as token ids, or (`text`) as text to tokenize."""
    import orjson

    return orjson.dumps(
        {
            "model": MODEL,
            "prompt": prompt_text(request.prompt) if text else request.prompt,
            "max_tokens": request.output_tokens,
            "stream": True,
        }
    )


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def _role_figures(cluster: Cluster, role: str) -> dict[str, Any]:
    engines = cluster.prefill if role == "prefill" else cluster.decode
    prompt = sum(e.totals.prompt_tokens for e in engines)
    cached = sum(e.totals.cached_tokens for e in engines)
    return {
        "legs": sum(e.totals.legs for e in engines),
        "prompt_tokens": prompt,
        "computed_tokens": sum(e.totals.computed_tokens for e in engines),
        "cached_tokens": cached,
        "cached_share": round(cached / prompt, 4) if prompt else 0.0,
        "legs_per_engine": {e.name: e.totals.legs for e in engines},
        "peak_queue": {e.name: e.totals.peak_queue for e in engines},
        # a data-parallel server's legs by rank (servers without ranks are left out)
        "legs_per_rank": {
            e.name: dict(sorted(e.totals.rank_legs.items())) for e in engines if len(e.ranks) > 1
        },
    }


def summarise(
    name: str, outcomes: list[Outcome], cluster: Cluster, settings: Settings, started: float
) -> dict[str, Any]:
    """The figures of one configuration's run (times in ms of simulated time)."""
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpots = [o.tpot_s for o in ok if o.tpot_s is not None]
    good = [
        o
        for o in ok
        if o.ttft_s is not None
        and o.ttft_s * 1e3 <= settings.slo_ttft_ms
        and (o.tpot_s is None or o.tpot_s * 1e3 <= settings.slo_tpot_ms)
    ]
    span = max((o.finished_at for o in outcomes), default=started) - started
    strategies: dict[str, int] = {}
    for o in ok:
        strategies[o.strategy] = strategies.get(o.strategy, 0) + 1
    failures: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            failures[str(o.status)] = failures.get(str(o.status), 0) + 1
    return {
        "name": name,
        "ttft_ms": {q: _ms(percentile(ttfts, float(q[1:]))) for q in ("p50", "p90", "p99")},
        # a lockstep burst's TTFTs are a staircase whose p50 sits on one step or the next
        "ttft_mean_ms": _ms(sum(ttfts) / len(ttfts)) if ttfts else None,
        "tpot_ms": {q: _ms(percentile(tpots, float(q[1:]))) for q in ("p50", "p99")},
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "failures_by_status": failures,
        "goodput": {
            "ttft_slo_ms": settings.slo_ttft_ms,
            "tpot_slo_ms": settings.slo_tpot_ms,
            "requests": len(good),
            "share": round(len(good) / len(outcomes), 4) if outcomes else 0.0,
            "per_s": round(len(good) / span, 3) if span > 0 else 0.0,
        },
        "decode_only_share": round(strategies.get("decode_only", 0) / len(ok), 4) if ok else 0.0,
        "strategies": strategies,
        "prefill": _role_figures(cluster, "prefill"),
        "decode": _role_figures(cluster, "decode"),
        "simulated_s": round(span, 3),
    }
