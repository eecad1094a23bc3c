#!/usr/bin/env python3
"""Routing by the KV cache: pd-extproc's policies against vllm-router's cache-aware ones.

On the same vllmsim push engines (nPnD, the default cost profile, prefix caching on, every
engine publishing vLLM's KV events over ZMQ), these configurations are started at once:

  pd-rr         pd-extproc, push, round_robin on both pools (pd-extproc without the scorer)
  pd-prefix     pd-extproc, push, `prefix` on both pools (a hash of the prompt's first bytes)
  pd-cache      pd-extproc with the cache-aware scorer: pd_cache_sections() below (kv_cache
                on both pools, fed every engine's KV events)
  pd-cache+decide  pd-cache with the load-aware decision (decode-only where D holds the
                prompt and its load allows)
  pd-approx     pd-cache+decide with neither KV events nor a tokenizer (the scorer's
                approximate mode: what this sidecar routed where)
  router-cache  vllm-router 0.1.17, PD mode, cache_aware (its own radix tree of routed text)
  router-kv     vllm-router 0.1.17, PD mode, kv_aware, fed the prefills' KV events by
                --pd-kv-events (skipped when the engines cannot publish them)

and `vllm bench serve` drives three workloads at each concurrency C (bench/workload.py):

  shared-prefix  G system prompts of S tokens, a fresh question of Q tokens per request,
                 max(64, 4 × C) requests (--min-requests, --requests-per-c)
  multi-turn     max(8, 2 × C) conversations of T turns (--min-conversations,
                 --conversations-per-c); the client sends turn k of every conversation as
                 one run (C at a time), turn k + 1 only after all of turn k
  random         vllm bench serve's random 1024 in / 64 out, max(0, 2 × C) prompts
                 (--random-min, --random-per-c)

The regime (--regime) says how much the caches can hold:

  tight (default)  as deployments run: more groups than one prefill engine can keep. G = 8 × n
                   groups (16 on 2P2D, 32 on 4P4D) of S = 2048 tokens, and every prefill
                   engine's KV cache (vllmsim --num-gpu-blocks) holds 1.25 × G / n system
                   prompts (10): the pool holds every group's with a quarter to spare, one
                   engine about half of them on 2P2D. Decode engines keep the profile's blocks
                   (D's cache must hold its running requests' whole prompts).
  roomy            the first run's: G = 8, S = 1024, the profile's blocks everywhere (every
                   engine holds every group's system prompt).

--groups, --system-tokens and --prefill-kv-blocks override the regime's.

Every run gets its own words (a salt per configuration, C and repetition), so that no
configuration finds blocks another one left in the caches; the shape (groups, lengths, order)
is the same for all. Between runs the harness reads every engine's /metrics, so each cell also
reports the share of prompt tokens the prefill and the decode engines found in their caches
and the prompt tokens they computed. Aim: pd-cache's (and pd-cache+decide's) TTFT p50 and p99
≤ 0.7 × vllm-router's best policy on shared-prefix and multi-turn, ≤ 1.02 × pd-rr on random;
every cell is checked.
Output: bench/results/cache.md, cache.json, cache.png.

    python bench/cache.py                   # 2P2D and 4P4D, C = 4, 16, 64, 1 run, tight
    python bench/cache.py --regime roomy    # the first run's regime
    python bench/cache.py --topologies 2P2D --concurrency 4 --workloads shared-prefix \\
        --requests-per-c 2 --turns 2        # a smoke run
    python bench/cache.py --vllmsim-from ../other-checkout   # engines from another tree
    python bench/cache.py --sample-engines 0.2 ...   # also what the engines did, per cell

--sample-engines SECONDS (bench/engine_probe.py): every engine's running and waiting requests
(vllmsim's GET /sim/state) every SECONDS during the measured runs, each engine's step lateness
(how much later than its cost model its steps ended: the machine's CPU, which no lab models)
and each pd-extproc sidecar's decode-only decisions, per cell: a table in cache.md, the figures
in cache.json's "engine_probe". The samples cost the engines' CPU a little. --merge drops them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from bench import report
from bench.client import Run, run_plan, warmups
from bench.engine_probe import EngineProbe
from bench.engines import Engines, running_engines
from bench.procs import pinned, run_bench
from bench.run import MODEL, RESULTS, _slim, commit, cpu_split
from bench.targets import Target, running_router
from bench.workload import MultiTurn, SharedPrefix, multi_turn, shared_prefix, turn_waves, write
from extproc.config import ConfigError, parse_config
from extproc.testing import ephemeral_config, running_sidecar, scrape
from scripts.cached_envs import tiny_model, vllm_router_venv
from vllmsim.launcher import EngineHandle, vllmsim_command
from vllmsim.profiles import DEFAULT_PROFILE, PROFILES

WORKLOADS = ("shared-prefix", "multi-turn", "random")
CACHE_WORKLOADS = ("shared-prefix", "multi-turn")
CACHE_CONFIGS = ("pd-cache", "pd-cache+decide")  # checked against the aim
ROUTERS = ("router-cache", "router-kv")
AIM_VS_ROUTER, AIM_VS_BASELINE = 0.7, 1.02
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
BLOCK = 16  # tokens per KV block (vllmsim's, vLLM's default)
REGIMES = ("tight", "roomy")


@dataclass(frozen=True)
class Regime:
    """How much the engines' caches hold against the shared-prefix workload, per topology."""

    shape: SharedPrefix
    prefill_kv_blocks: int | None  # vllmsim --num-gpu-blocks of every P; None: the profile's

    def describe(self, n: int) -> str:
        prompts = self.shape.groups
        if self.prefill_kv_blocks is None:
            return (
                f"G = {prompts} system prompts of {self.shape.system_tokens} tokens; "
                "the profile's KV blocks"
            )
        held = self.prefill_kv_blocks / prefix_blocks(self.shape)
        return (
            f"G = {prompts} system prompts of {self.shape.system_tokens} tokens "
            f"({prefix_blocks(self.shape)} blocks each); every P's KV cache "
            f"{self.prefill_kv_blocks} blocks: {held:.1f} of the {prompts} prompts on one, "
            f"{n * held:.0f} on the {n}; D: the profile's blocks"
        )


def prefix_blocks(shape: SharedPrefix) -> int:
    """The full blocks of one group's system prompt (with the BOS)."""
    return (1 + shape.system_tokens) // BLOCK


def regime(args: argparse.Namespace, n: int) -> Regime:
    """The workload shape and prefill cache size of `args.regime` on nPnD, with the flags
    given overriding it."""
    tight = args.regime == "tight"
    groups = args.groups or (8 * n if tight else 8)
    system = args.system_tokens or (2048 if tight else 1024)
    shape = SharedPrefix(groups, system, args.question_tokens)
    blocks = args.prefill_kv_blocks
    if blocks is None and tight:
        blocks = math.ceil(1.25 * groups / n * prefix_blocks(shape))
    return Regime(shape, blocks)


@dataclass(frozen=True)
class EventSockets:
    """Where one engine publishes its KV events (ZMQ PUB) and answers replays (ROUTER)."""

    endpoint: str
    replay_endpoint: str


EventPorts = dict[str, EventSockets]  # engine URL (http://127.0.0.1:PORT) → its sockets


def pd_cache_sections(engines: Engines, events: EventPorts) -> dict[str, Any]:
    """pd-extproc's cache-aware configuration, merged into its config: `kv_cache` on both
    pools, each engine's own ipc:// event sockets (`events`, by engine URL; without events the
    policy scores engines by the prompts routed to them), and the engines' tokenizer."""

    def pool(handles: list[EngineHandle]) -> dict[str, Any]:
        endpoints = []
        for handle in handles:
            endpoint: dict[str, Any] = {"address": f"127.0.0.1:{handle.port}"}
            if (sockets := events.get(handle.url)) is not None:
                endpoint["kv_events"] = {
                    "endpoint": sockets.endpoint,
                    "replay_endpoint": sockets.replay_endpoint,
                }
            endpoints.append(endpoint)
        # the pool's kv_events turns the subscriptions on; every endpoint names its own sockets
        return {
            "policy": "kv_cache",
            **({"kv_events": {}} if events else {}),
            "endpoints": endpoints,
        }

    return {
        "prefill": pool(engines.prefill),
        "decode": pool(engines.decode),
        "tokenizer": str(tiny_model()),
    }


def pd_cache_decide_sections(engines: Engines, events: EventPorts) -> dict[str, Any]:
    """pd-cache with the load-aware decision (decode-only where D holds enough of the prompt
    and its load allows), at the decision's default step costs."""
    return {**pd_cache_sections(engines, events), "decision": {"mode": "load_aware"}}


def pd_approx_sections(engines: Engines, events: EventPorts) -> dict[str, Any]:
    """pd-cache+decide without engine flags or a tokenizer: the scorer's approximate mode
    (what this sidecar routed where, over the prompt's bytes)."""
    sections = pd_cache_decide_sections(engines, {})
    del sections["tokenizer"]
    return sections


def _pools(policy: str) -> Callable[[Engines, EventPorts], dict[str, Any]]:
    return lambda engines, events: {"prefill": {"policy": policy}, "decode": {"policy": policy}}


@dataclass(frozen=True)
class Config:
    name: str
    sections: Callable[[Engines, EventPorts], dict[str, Any]] | None = None  # pd-extproc's
    router_policy: str | None = None  # vllm-router's
    needs_events: bool = False


CONFIGS = {
    c.name: c
    for c in (
        Config("pd-rr", _pools("round_robin")),
        Config("pd-prefix", _pools("prefix")),
        Config("pd-cache", pd_cache_sections),
        Config("pd-cache+decide", pd_cache_decide_sections),
        Config("pd-approx", pd_approx_sections),
        Config("router-cache", router_policy="cache_aware"),
        Config("router-kv", router_policy="kv_aware", needs_events=True),
    )
}


# ------------------------------------------------------------------------------ engines


def engine_cache_flags(env: dict[str, str]) -> tuple[bool, str]:
    """(whether the installed vllmsim takes vLLM's prefix-caching and KV-events flags, why)."""
    proc = subprocess.run(
        [*vllmsim_command(), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=False,
    )
    missing = [f for f in ("--enable-prefix-caching", "--kv-events-config") if f not in proc.stdout]
    if missing:
        return False, f"this vllmsim has no {' or '.join(missing)} (no prefix cache, no events)"
    return True, "prefix caching and KV events on"


def events_config(endpoint: str, replay_endpoint: str) -> str:
    """vLLM's --kv-events-config: a ZMQ PUB on `endpoint`, the replay socket on the other."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
        }
    )


@dataclass
class EventFlags:
    """Each engine's KV-event sockets, named before it starts (vllm-router needs them up front).

    ipc:// sockets in the run's directory: vLLM's publisher binds only wildcard and ipc
    endpoints (it connects to tcp://host:port, where a subscriber that connects as well, such
    as vllm-router's, would never meet it), and a wildcard would listen on every interface.
    """

    enabled: bool
    folder: Path
    by_slot: dict[tuple[str, int], EventSockets] = field(default_factory=dict)

    def __call__(self, role: str, index: int) -> list[str]:
        if not self.enabled:
            return []
        base = f"ipc://{self.folder}/{role[0]}{index}"
        sockets = self.by_slot[(role, index)] = EventSockets(base + ".pub", base + ".replay")
        return [
            "--enable-prefix-caching",
            "--kv-events-config",
            events_config(sockets.endpoint, sockets.replay_endpoint),
        ]

    def endpoints(self, engines: Engines) -> EventPorts:
        out = {}
        for role, handles in (("prefill", engines.prefill), ("decode", engines.decode)):
            for index, handle in enumerate(handles):
                if (role, index) in self.by_slot:
                    out[handle.url] = self.by_slot[(role, index)]
        return out


_SOURCE = re.compile(r'source="([^"]+)"')


async def cache_counters(http: aiohttp.ClientSession, engines: Engines) -> dict[str, float]:
    """Per role: prompt tokens by source, prefix-cache queries and hits (absent: not there)."""
    out: dict[str, float] = defaultdict(float)
    for role, handles in (("P", engines.prefill), ("D", engines.decode)):
        for handle in handles:
            for key, value in (await scrape(http, handle.url + "/metrics")).items():
                name = key.split("{", 1)[0]
                if name == "vllm:prompt_tokens_by_source_total" and (m := _SOURCE.search(key)):
                    out[f"{role} {m.group(1)}"] += value
                elif name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                    out[f"{role} {name.split(':')[1].removesuffix('_total')}"] += value
    return dict(out)


# ------------------------------------------------------------------------------ targets


@contextlib.asynccontextmanager
async def running_config(
    config: Config, engines: Engines, events: EventPorts, cpus: set[int] | None
) -> AsyncIterator[Target]:
    if config.router_policy is not None:
        extra = []
        if config.needs_events:
            for handle in engines.prefill:
                extra += ["--pd-kv-events", f"{handle.url}={events[handle.url].endpoint}"]
        async with running_router(
            engines,
            vllm_router_venv() / "bin" / "vllm-router",
            cpus,
            config.router_policy,
            config.name,
            extra,
        ) as target:
            yield target
        return
    assert config.sections is not None
    with pinned(cpus):
        runner = running_sidecar(extproc_config(config, engines, events), log_level="WARNING")
        sidecar = await runner.__aenter__()
    try:
        yield Target(config.name, sidecar.url, sidecar.pid, sidecar.metrics, sidecar.envoy_admin)
    finally:
        await runner.__aexit__(None, None, None)


def extproc_config(config: Config, engines: Engines, events: EventPorts) -> dict[str, Any]:
    assert config.sections is not None
    out = ephemeral_config(
        engines.addresses("prefill"), engines.addresses("decode"), dispatch={"mode": "push"}
    )
    for key, value in config.sections(engines, events).items():  # one level deep, as theirs
        out[key] = {**out[key], **value} if isinstance(out.get(key), dict) else value
    return out


def runnable(
    config: Config, engines: Engines, events: EventPorts, has_events: bool, why_not: str
) -> str | None:
    """None when the configuration can run here, else the one-line reason it is skipped."""
    if config.needs_events and not has_events:
        return f"{config.name} skipped: {why_not}"
    if config.sections is not None:
        try:
            parse_config(extproc_config(config, engines, events))
        except ConfigError as error:
            first = str(error).strip().splitlines()[0]
            return f"{config.name} skipped: its config does not validate on this tree ({first})"
    return None


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Cell:
    workload: str
    topology: str
    config: str
    concurrency: int

    @property
    def key(self) -> str:  # what report.cells groups by, as its "topology"
        return f"{self.workload}/{self.topology}"


def cell_runs(cell: Cell, index: int, args: argparse.Namespace, url: str, work: Path) -> list[Run]:
    """A warm-up (random prompts, sharing next to nothing with the measured ones), then the
    cell's measured runs: one, or one per turn for multi-turn."""
    conc, tag = cell.concurrency, f"{cell.key}-{cell.config}-c{cell.concurrency}-r{index}"
    tag = tag.replace("/", "-")
    salt = f"{cell.config}/{conc}/{index}/{cell.topology}"
    seed = args.seed + index
    warm = Run(
        f"{tag}-warm",
        cell.key,
        cell.config,
        conc,
        index,
        url,
        work / f"{tag}-warm.json",
        num_prompts=warmups(conc),
        num_warmups=0,
        seed=hash_seed(salt, "warm"),
    )
    runs = [warm]
    if cell.workload == "random":
        runs.append(
            Run(
                tag,
                cell.key,
                cell.config,
                conc,
                index,
                url,
                work / f"{tag}.json",
                num_prompts=max(args.random_min, args.random_per_c * conc),
                num_warmups=0,
                seed=hash_seed(salt, "random"),
            )
        )
    elif cell.workload == "shared-prefix":
        count = max(args.min_requests, args.requests_per_c * conc)
        shape = regime(args, int(cell.topology[0])).shape
        rows = shared_prefix(tiny_model(), shape, count, seed, salt)
        runs.append(_file_run(tag, cell, index, url, work, rows, seed))
    else:
        conversations = max(args.min_conversations, args.conversations_per_c * conc)
        shape = MultiTurn(**{**vars(args.chat), "conversations": conversations})
        # each wave shuffled with a seed of its own: in a fixed order, round robin over an
        # even pool would send every conversation to the same engines turn after turn
        for turn, wave in enumerate(turn_waves(multi_turn(tiny_model(), shape, seed, salt))):
            runs.append(
                _file_run(
                    f"{tag}-t{turn}", cell, index, url, work, wave, hash_seed(salt, f"turn {turn}")
                )
            )
    return runs


def _file_run(
    run_id: str, cell: Cell, index: int, url: str, work: Path, rows: list[dict], seed: int
) -> Run:
    path = work / f"{run_id}.jsonl"
    write(path, [{"prompt": r["prompt"], "output_tokens": r["output_tokens"]} for r in rows])
    return Run(
        run_id,
        cell.key,
        cell.config,
        cell.concurrency,
        index,
        url,
        work / f"{run_id}.json",
        path,
        num_prompts=len(rows),
        num_warmups=0,
        seed=seed,
    )


def hash_seed(*parts: str) -> int:
    """A client seed of its own per run (random prompts that no other run repeats)."""
    import hashlib

    return int.from_bytes(hashlib.sha256("/".join(parts).encode()).digest()[:4], "big")


def plan(
    topology: str, targets: dict[str, Target], args: argparse.Namespace, work: Path
) -> tuple[list[Run], dict[str, Cell]]:
    """Interleaved per (repetition, workload, C), the configuration order rotating; returns
    the runs and, for every measured run, its cell."""
    names, runs, cells = list(targets), [], {}
    for index in range(args.runs):
        for w_index, workload in enumerate(args.workloads):
            for conc in args.concurrency:
                shift = (index + w_index + conc) % len(names)
                for name in names[shift:] + names[:shift]:
                    cell = Cell(workload, topology, name, conc)
                    mine = cell_runs(cell, index, args, targets[name].url, work)
                    runs += mine
                    cells |= {r.id: cell for r in mine[1:]}
    return runs, cells


# ------------------------------------------------------------------------------ running


Counters = dict[str, dict[str, float]]  # cell id → the engines' cache counters over its runs


async def bench_topology(
    topology: str, args: argparse.Namespace, work: Path, notes: list[str], probes: dict[str, Any]
) -> tuple[list[dict], Counters]:
    """The topology's runs and cache counters; with --sample-engines, what the engines and
    the sidecars did per cell goes into `probes` (bench/engine_probe.py)."""
    n = int(topology[0])
    engine_cpus, proxy_cpus = cpu_split(args.pin)
    has_events, why = engine_cache_flags(args.engine_env)
    flags = EventFlags(has_events, work / f"events-{topology}")
    flags.folder.mkdir()
    mine = regime(args, n)
    blocks = (
        [] if mine.prefill_kv_blocks is None else ["--num-gpu-blocks", str(mine.prefill_kv_blocks)]
    )

    def own_flags(role: str, index: int) -> list[str]:
        return [*flags(role, index), *(blocks if role == "prefill" else [])]

    async with contextlib.AsyncExitStack() as stack:
        engines = await stack.enter_async_context(
            running_engines(
                "push",
                n,
                n,
                MODEL,
                tiny_model(),
                ("--profile", args.profile),
                engine_cpus,
                own_flags,
                args.engine_env,
            )
        )
        events = flags.endpoints(engines)
        notes.append(f"{topology}: engines: {why}; {args.regime} regime: {mine.describe(n)}")
        targets = {}
        for name in args.configs:
            if reason := runnable(CONFIGS[name], engines, events, has_events, why):
                print(reason, flush=True)
                notes.append(f"{topology}: {reason}")
                continue
            targets[name] = await stack.enter_async_context(
                running_config(CONFIGS[name], engines, events, proxy_cpus)
            )
        runs, cells = plan(topology, targets, args, work)
        print(f"{topology}: {len(runs)} runs over {', '.join(targets)}", flush=True)
        deltas: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        probe = EngineProbe(
            engines,
            {
                name: t.metrics
                for name, t in targets.items()
                if name.startswith("pd-") and t.metrics
            },
            args.sample_engines or 0.0,
        )
        async with aiohttp.ClientSession() as http:
            last: dict[str, float] = {}

            async def between(done: str | None, upcoming: str | None) -> None:
                nonlocal last
                now = await cache_counters(http, engines)
                if done in cells:
                    for key, value in now.items():
                        deltas[_cell_id(cells[done])][key] += value - last.get(key, 0.0)
                last = now
                if args.sample_engines:
                    await probe.boundary(http, _run_cell(cells, done), _run_cell(cells, upcoming))

            async with probe.sampling(http) if args.sample_engines else contextlib.nullcontext():
                results = await run_plan(runs, MODEL, tiny_model(), work, engine_cpus, between)
        if args.sample_engines:
            probes.update(probe.summary())
    records = [
        {
            "topology": r.topology,
            "config": r.config,
            "concurrency": r.concurrency,
            "index": r.index,
            **_slim(results[r.id]),
        }
        for r in runs
        if r.id in cells
    ]
    return records, {k: dict(v) for k, v in deltas.items()}


def _cell_id(cell: Cell) -> str:
    return f"{cell.key}|{cell.config}|{cell.concurrency}"


def _run_cell(cells: dict[str, Cell], run_id: str | None) -> str | None:
    """The cell id of a measured run, None for a warm-up (or no run)."""
    return _cell_id(cells[run_id]) if run_id in cells else None


# ------------------------------------------------------------------------------ report


def _f(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def cache_columns(counters: dict[str, float]) -> list[str]:
    """P cached %, D cached %, P computed, D computed (prompt tokens; — where not exported)."""
    out = []
    for role in ("P", "D"):
        by_source = [counters.get(f"{role} {s}") for s in SOURCES]
        total = sum(v for v in by_source if v is not None)
        hit, queries = (
            counters.get(f"{role} prefix_cache_hits"),
            counters.get(f"{role} prefix_cache_queries"),
        )
        if total and by_source[1] is not None:
            out.append(f"{100 * by_source[1] / total:.1f}")
        elif queries:
            out.append(f"{100 * (hit or 0) / queries:.1f} (of queries)")
        else:
            out.append("—")
    for role in ("P", "D"):
        computed = counters.get(f"{role} local_compute")
        out.append("—" if computed is None else f"{computed:.0f}")
    return out


def section(
    table: dict,
    deltas: Counters,
    workload: str,
    topology: str,
    args: argparse.Namespace,
    configs: list[str],
) -> tuple[list[str], list[tuple[str, str]]]:
    """(the table's lines, the aim's misses as (config, what)) of one workload on one
    topology."""
    key = f"{workload}/{topology}"
    head = [
        "C",
        "config",
        "TTFT p50",
        "TTFT p99",
        "TPOT p99",
        "P cached %",
        "D cached %",
        "P computed",
        "D computed",
        "p50 / best router",
        "p99 / best router",
        "aim",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    misses: list[tuple[str, str]] = []
    for conc in args.concurrency:

        def get(config: str, metric: str, conc: int = conc) -> float | None:
            return table.get((key, config, conc), {}).get(metric)

        best = {
            m: min((v for r in ROUTERS if (v := get(r, m)) is not None), default=None)
            for m in ("median_ttft_ms", "p99_ttft_ms")
        }
        for config in configs:
            ratios = [
                get(config, m) / best[m] if get(config, m) and best[m] else None
                for m in ("median_ttft_ms", "p99_ttft_ms")
            ]
            verdict = ""
            if config in CACHE_CONFIGS:
                verdict, missed = aim(get, config, workload, best)
                misses += [(config, f"{topology} C={conc}: {m}") for m in missed]
            lines.append(
                "| "
                + " | ".join(
                    [
                        str(conc),
                        config,
                        _f(get(config, "median_ttft_ms")),
                        _f(get(config, "p99_ttft_ms")),
                        _f(get(config, "p99_tpot_ms"), 2),
                        *cache_columns(deltas.get(f"{key}|{config}|{conc}", {})),
                        *(_f(r, 2) for r in ratios),
                        verdict,
                    ]
                )
                + " |"
            )
    return lines, misses


def aim(
    get: Callable[[str, str], float | None],
    config: str,
    workload: str,
    best: dict[str, float | None],
) -> tuple[str, list[str]]:
    """`config` (a cache-aware one) against the aim of this workload: (verdict, what missed)."""
    if workload in CACHE_WORKLOADS:
        limit, against, name = AIM_VS_ROUTER, best, "best router"
    else:
        limit, name = AIM_VS_BASELINE, "pd-rr"
        against = {m: get("pd-rr", m) for m in ("median_ttft_ms", "p99_ttft_ms")}
    missed = []
    for metric, label in (("median_ttft_ms", "p50"), ("p99_ttft_ms", "p99")):
        mine, theirs = get(config, metric), against[metric]
        if mine is None or theirs is None:
            missed.append(f"{label} not measured")
        elif mine > limit * theirs:
            missed.append(f"{label} {mine / theirs:.2f} × {name} > {limit}")
    return ("met" if not missed else "MISSED " + "; ".join(missed)), missed


def write_outputs(
    records: list[dict],
    deltas: dict,
    args: argparse.Namespace,
    meta: dict,
    notes: list[str],
    probes: dict[str, Any] | None = None,
) -> None:
    table = report.cells(records)
    ran = list(dict.fromkeys(r["config"] for r in records))
    lines = [
        "# Routing by the KV cache: pd-extproc against vllm-router, vllmsim engines",
        "",
        f"Profile {args.profile}; {meta['when']}; {runs_per_cell(records, args)}, pooled; "
        f"{meta['duration_s']:.0f} s; load average before {meta['load_before']}, after "
        f"{meta['load_after']}; 1-minute load average during the run (every 30 s) "
        f"{meta['load_during']}; pinning: {meta['pinning']}; commit {meta['commits']}. TTFT "
        "and TPOT in ms; cached % = prompt tokens found in the engines' prefix caches "
        "over all prompt tokens of that role (vllm:prompt_tokens_by_source_total), "
        "computed = prompt tokens the role prefilled itself. Best router: per cell, the "
        f"lower of {', '.join(ROUTERS)}. Aim ({', '.join(CACHE_CONFIGS)}): TTFT p50 and p99 ≤ "
        f"{AIM_VS_ROUTER} × best router on {', '.join(CACHE_WORKLOADS)}, ≤ "
        f"{AIM_VS_BASELINE} × pd-rr on random.",
        "",
        f"Workloads: shared-prefix ({args.regime} regime: groups, system prompt and P's KV "
        f"cache per topology below), question {args.question_tokens} tokens, "
        f"max({args.min_requests}, "
        f"{args.requests_per_c} × C) requests; multi-turn "
        f"{ {k: v for k, v in vars(args.chat).items() if k != 'conversations'} }, "
        f"max({args.min_conversations}, {args.conversations_per_c} × C) conversations; "
        f"random 1024 / 64, max({args.random_min}, {args.random_per_c} × C) prompts; seed "
        f"{args.seed}.",
        "",
        *(f"- {n}" for n in notes),
        "",
    ]
    all_misses: list[tuple[str, str]] = []
    for topology in args.topologies:
        for workload in args.workloads:
            body, misses = section(table, deltas, workload, topology, args, ran)
            all_misses += [(config, f"{workload} {m}") for config, m in misses]
            lines += [f"## {workload}, {topology}", "", *body, ""]
    lines += ["## Aim", ""]
    for config in CACHE_CONFIGS:
        mine = [m for name, m in all_misses if name == config]
        lines.append(
            f"- {config}: "
            + (
                "did not run"
                if config not in ran
                else "misses: " + ("; ".join(mine) if mine else "none")
            )
        )
    lines.append("")
    if probes:
        lines += probe_section(probes, args.sample_engines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache.md").write_text("\n".join(lines))
    (args.out / "cache.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "notes": notes,
                "cache_counters": deltas,
                "engine_probe": probes or {},
                "runs": records,
            },
            indent=1,
        )
    )
    plot(table, args, ran, args.out / "cache.png")
    print("\n".join(lines))


def probe_section(probes: dict[str, Any], every_s: float) -> list[str]:
    """--sample-engines' table: per cell and engine, the batch and queue sampled, the steps'
    lateness; the decode-only decisions of the cell's sidecar."""
    head = [
        "cell",
        "engine",
        "running mean / p50 / p90 / max",
        "waiting mean / max",
        "steps",
        "late ms per step",
        "steps late > 5 / 20 ms %",
        "CPU %",
        "decode-only (the cell's)",
        "without token ids (the cell's)",
    ]
    lines = [
        "## Engines during the runs",
        "",
        f"Every engine's GET /sim/state every {every_s:g} s during the measured runs; step "
        "lateness: how much later than the cost model its steps ended (the CPU came late); "
        "CPU %: the engine process's CPU time over the runs' wall time; decode-only: the "
        "sidecar's decisions (pd_extproc_dispatch_decisions_total); without token ids: "
        "requests its tokenizer did not give ids in time (pd_extproc_kv_untokenized_requests).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for cell, seen in probes.items():
        decode_only = sum(v for k, v in seen["decisions"].items() if "decode_only" in k)
        without_ids = seen.get("untokenized", 0.0)
        busy = ", ".join(f"{cpu} {100 * b:.0f} %" for cpu, b in seen.get("cpu_busy", {}).items())
        label = cell.replace("|", " ") + (f" (CPU busy: {busy})" if busy else "")
        for name, e in seen["engines"].items():
            run, wait, steps = e["running"], e["waiting"], e.get("steps", 0)
            late = [e.get(f"late>{le}ms", 0) for le in (5.0, 20.0)]
            lines.append(
                "| "
                + " | ".join(
                    [
                        label,
                        name,
                        " / ".join(str(run.get(k, "—")) for k in ("mean", "p50", "p90", "max")),
                        f"{wait.get('mean', '—')} / {wait.get('max', '—')}",
                        f"{steps:.0f}",
                        _f(1e3 * e.get("late_s", 0.0) / steps if steps else None, 2),
                        " / ".join(_f(100 * n / steps if steps else None) for n in late),
                        _f(100 * e["cpu_share"] if e.get("cpu_share") is not None else None, 0),
                        f"{decode_only:.0f}" if name.startswith("D") else "",
                        f"{without_ids:.0f}" if name.startswith("P") else "",
                    ]
                )
                + " |"
            )
    return [*lines, ""]


def plot(table: dict, args: argparse.Namespace, configs: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt

    columns = [(w, t) for t in args.topologies for w in args.workloads]
    fig, axes = plt.subplots(2, len(columns), figsize=(5 * len(columns), 8), squeeze=False)
    for column, (workload, topology) in enumerate(columns):
        for row, (metric, label) in enumerate(
            (("median_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"))
        ):
            ax = axes[row][column]
            for index, config in enumerate(configs):
                points = [
                    (c, v)
                    for c in args.concurrency
                    if (v := table.get((f"{workload}/{topology}", config, c), {}).get(metric))
                    is not None
                ]
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=config, color=f"C{index}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.set_title(f"{workload}, {topology}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        axes[1][column].set_xlabel("concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="2P2D,4P4D")
    parser.add_argument("--concurrency", default="4,16,64")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--runs", type=int, default=1, help="repetitions per cell")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--requests-per-c", type=int, default=4, help="shared-prefix requests")
    parser.add_argument(
        "--min-requests", type=int, default=64, help="shared-prefix requests at least"
    )
    parser.add_argument(
        "--conversations-per-c", type=int, default=2, help="multi-turn conversations"
    )
    parser.add_argument(
        "--min-conversations", type=int, default=8, help="multi-turn conversations at least"
    )
    parser.add_argument("--random-per-c", type=int, default=2, help="random prompts")
    parser.add_argument("--random-min", type=int, default=0, help="random prompts at least")
    parser.add_argument(
        "--regime", choices=REGIMES, default="tight", help="what the caches hold (see above)"
    )
    parser.add_argument("--groups", type=int, help="shared-prefix groups (default: the regime's)")
    parser.add_argument("--system-tokens", type=int, help="shared-prefix system prompt tokens")
    parser.add_argument(
        "--prefill-kv-blocks", type=int, help="every P's KV cache, in blocks (--num-gpu-blocks)"
    )
    parser.add_argument("--question-tokens", type=int, default=SharedPrefix.question_tokens)
    parser.add_argument("--turns", type=int, default=MultiTurn.turns)
    parser.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    parser.add_argument(
        "--vllmsim-from",
        type=Path,
        metavar="DIR",
        help="run the engines' vllmsim package from this checkout",
    )
    parser.add_argument(
        "--sample-engines",
        type=float,
        metavar="SECONDS",
        help="sample every engine's batch and queue this often during the runs, and record "
        "its step lateness and the sidecar's decisions per cell (see above)",
    )
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: write one report from these runs' cache.json (the same flags)",
    )
    args = parser.parse_args()
    args.topologies = args.topologies.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.workloads, args.configs = args.workloads.split(","), args.configs.split(",")
    for name, given, known in (
        ("workloads", args.workloads, WORKLOADS),
        ("configs", args.configs, tuple(CONFIGS)),
    ):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"unknown {name} {unknown}; choose from {', '.join(known)}")
    if bad := [t for t in args.topologies if not re.fullmatch(r"([1-9])P\1D", t)]:
        parser.error(f"topologies are nPnD with n in 1..9, not {bad}")
    for name in ("groups", "system_tokens", "prefill_kv_blocks"):
        if (value := getattr(args, name)) is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    args.chat = MultiTurn(turns=args.turns)
    root = args.vllmsim_from
    if root is not None and not (root / "vllmsim" / "__init__.py").is_file():
        parser.error(f"--vllmsim-from {root}: no vllmsim package there")
    args.engine_env = {"PYTHONPATH": str(root.resolve())} if root else {}
    return args


async def sample_load(samples: list[float], every_s: float = 30.0) -> None:
    """The 1-minute load average, every `every_s` (the machine is shared: say how busy)."""
    while True:
        samples.append(os.getloadavg()[0])
        await asyncio.sleep(every_s)


def load_summary(samples: list[float]) -> str:
    if not samples:
        return "not sampled"
    ordered = sorted(samples)
    return (
        f"min {ordered[0]:.1f}, median {ordered[len(ordered) // 2]:.1f}, max {ordered[-1]:.1f} "
        f"({len(samples)} samples)"
    )


def merged(paths: list[Path]) -> tuple[list[dict], dict, dict, list[str]]:
    """The records, counters, meta and notes of several runs' cache.json (one topology
    each, say), as one: durations added, load samples pooled, the rest joined."""
    records: list[dict] = []
    deltas: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    notes: list[str] = []
    metas = []
    for source, path in enumerate(paths):
        saved = json.loads(path.read_text())
        records += [{**r, "source": source} for r in saved["runs"]]
        for cell, counters in saved["cache_counters"].items():  # a cell run twice: summed
            for key, value in counters.items():
                deltas[cell][key] += value
        notes += [n for n in saved["notes"] if n not in notes]
        metas.append(saved["meta"])
    samples = [x for m in metas for x in m.get("load_1m_samples", [])]
    meta = {
        **metas[0],
        "when": " and ".join(m["when"] for m in metas),
        "duration_s": sum(m["duration_s"] for m in metas),
        "load_before": " / ".join(m["load_before"] for m in metas),
        "load_after": " / ".join(m["load_after"] for m in metas),
        "load_during": load_summary(samples),
        "load_1m_samples": samples,
        "commits": " / ".join(dict.fromkeys(m["commits"] for m in metas)),
        "merged_from": [str(p) for p in paths],
    }
    return records, {k: dict(v) for k, v in deltas.items()}, meta, notes


def runs_per_cell(records: list[dict], args: argparse.Namespace) -> str:
    """How many runs each topology's cells pool (merged reports: the runs holding it)."""
    if not any("source" in r for r in records):
        return f"{args.runs} run(s) per cell"
    by_topology: dict[str, set[int]] = defaultdict(set)
    for r in records:
        by_topology[r["topology"].split("/")[1]].add(r["source"])
    return "runs per cell: " + ", ".join(f"{t} {len(s)}" for t, s in by_topology.items())


async def main() -> None:
    args = parse_args()
    if args.merge:
        records, deltas, meta, notes = merged(args.merge)
        write_outputs(records, deltas, args, meta, notes)
        return
    started, load_before = time.monotonic(), os.getloadavg()
    commits, records, deltas, notes = [commit()], [], {}, []
    probes: dict[str, Any] = {}
    samples: list[float] = []
    sampler = asyncio.create_task(sample_load(samples))
    try:
        with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
            for topology in args.topologies:
                mine, counters = await bench_topology(topology, args, Path(tmp), notes, probes)
                records += mine
                deltas |= counters
                commits.append(commit())
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    engine_cpus, proxy_cpus = cpu_split(args.pin)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "duration_s": time.monotonic() - started,
        "load_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "load_during": load_summary(samples),
        "load_1m_samples": samples,
        "pinning": f"engines and client on CPU {sorted(engine_cpus)}, proxies on CPU "
        f"{sorted(proxy_cpus or ())}"
        if engine_cpus
        else "none",
        "argv": sys.argv[1:],
        "commits": " → ".join(dict.fromkeys(commits)),
    }
    write_outputs(records, deltas, args, meta, notes, probes)


if __name__ == "__main__":
    run_bench(main())
