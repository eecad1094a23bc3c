"""When each picking policy helps: 2P2D vllmsim engines (default costs), one scenario each.

  slow-decode     D2 runs with --step-base-ms 20 (half the speed of D1): every policy that
                  counts load (least_request, power_of_two) should send it less.
  busy-decode     D1 (--max-num-seqs 4) also serves a client that bypasses this sidecar and
                  keeps it queued: power_of_two sees that queue in the engine's
                  vllm:num_requests_waiting; least_request only once this sidecar's own
                  requests pile up behind it.
  shared-prefix   requests come from 16 system prompts (~1000 tokens each, popularity
                  ~1/rank); prefix should send each prompt to one prefill engine.

vllmsim has no prefix cache (it never counts local_cache_hit tokens), so prefix affinity
cannot show up as TTFT here: the shared-prefix table reports the affinity itself: the share
of requests sent to the same prefill as the previous request with their prompt (a cache hit
on an engine with an LRU prefix cache), the number of prefill engines each prompt reached
(copies of its KV; 1 is ideal), and the busiest prefill's share of requests (balance).

Latencies are closed-loop (`--concurrency` clients, streaming); TTFT is the first SSE chunk.
This is a shared 2-core machine: compare rows within a table, not with other runs.

    python bench/policies.py [--requests 96] [--concurrency 8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import statistics
import sys
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engines import sim_requests
from bench.procs import run_bench
from extproc.testing import ephemeral_config, running_sidecar
from vllmsim.launcher import PUSH_D, PUSH_P, EngineHandle, running_engine

MODEL = "sim-model"
TEXT = "the keeper climbed the stairs to light the lamp before the storm came in " * 70
MARKER = re.compile(r"prompt (\d+) ")


@dataclass(frozen=True)
class Scenario:
    name: str
    policies: tuple[str, ...]  # a name from POLICIES, or "name option=value" (pool options)
    role: str  # the pool whose policy is varied
    decode_flags: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    external_load: int = 0  # requests kept in flight on D1 by another client
    groups: int = 0  # shared-prefix: number of distinct system prompts
    watch: tuple[str, int] | None = None  # (column, decode index): that engine's share


SCENARIOS = [
    Scenario(
        "slow-decode",
        ("round_robin", "random", "least_request", "power_of_two"),
        "decode",
        decode_flags=((), ("--step-base-ms", "20")),
        watch=("on slow D %", 1),
    ),
    Scenario(
        "busy-decode",
        ("round_robin", "least_request", "power_of_two"),
        "decode",
        decode_flags=(("--max-num-seqs", "4"), ()),
        external_load=12,
        watch=("on busy D %", 0),
    ),
    Scenario(
        "shared-prefix",
        (
            "round_robin",
            "least_request",
            "prefix",
            "prefix prefix_load_slack=0.25",
            "prefix prefix_load_slack=1.0",
        ),
        "prefill",
        groups=16,
    ),
]


@dataclass
class Sample:
    index: int
    ttft_s: float
    latency_s: float


def pool_options(policy: str) -> dict[str, Any]:
    """ "prefix prefix_load_slack=1.0" → {"policy": "prefix", "prefix_load_slack": 1.0}"""
    name, *options = policy.split()
    return {"policy": name} | {k: float(v) for k, v in (o.split("=") for o in options)}


def address(engine: EngineHandle) -> str:
    return f"127.0.0.1:{engine.port}"


@contextlib.asynccontextmanager
async def engines(scenario: Scenario) -> AsyncIterator[tuple[list[EngineHandle], ...]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(kv: str, flags: Sequence[str] = ()) -> EngineHandle:
            engine = running_engine("--kv-transfer-config", kv, "--log-level", "warning", *flags)
            return await stack.enter_async_context(engine)

        prefills = [await start(PUSH_P), await start(PUSH_P)]
        decodes = [await start(PUSH_D, flags) for flags in scenario.decode_flags]
        yield prefills, decodes


def prompt_for(scenario: Scenario, index: int, rng: random.Random) -> str:
    if not scenario.groups:
        return f"prompt {index} {TEXT}"
    ranks = range(1, scenario.groups + 1)
    group = rng.choices(ranks, weights=[1 / r for r in ranks])[0]
    return f"system {group}: {TEXT} prompt {index} what is next?"


async def one(http: aiohttp.ClientSession, url: str, index: int, prompt: str) -> Sample:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "stream": True}
    started = time.perf_counter()
    first = 0.0
    async with http.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for _ in response.content.iter_any():
            first = first or time.perf_counter()
    return Sample(index, first - started, time.perf_counter() - started)


async def closed_loop(
    http: aiohttp.ClientSession, url: str, prompts: list[str], concurrency: int
) -> list[Sample]:
    queue = list(enumerate(prompts))[::-1]
    samples: list[Sample] = []

    async def client() -> None:
        while queue:
            index, prompt = queue.pop()
            samples.append(await one(http, url, index, prompt))

    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(concurrency))), 600)
    return samples


async def keep_busy(http: aiohttp.ClientSession, engine: EngineHandle) -> None:
    """Another router's traffic on `engine`: one long request after the other."""
    body = {"model": MODEL, "prompt": "elsewhere " * 50, "max_tokens": 200}
    while True:
        async with http.post(engine.url + "/v1/completions", json=body) as response:
            await response.read()


async def served(http: aiohttp.ClientSession, engine: EngineHandle) -> list[dict[str, Any]]:
    records = await sim_requests(http, engine)
    return [r for r in records if MARKER.search(str((r["body"] or {}).get("prompt", "")))]


async def clear(http: aiohttp.ClientSession, all_engines: Sequence[EngineHandle]) -> None:
    for engine in all_engines:
        async with http.delete(engine.url + "/sim/requests") as response:
            response.raise_for_status()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def latency_row(samples: list[Sample], wall_s: float) -> dict[str, float]:
    ttft = [s.ttft_s * 1000 for s in samples]
    latency = [s.latency_s * 1000 for s in samples]
    return {
        "TTFT mean ms": statistics.fmean(ttft),
        "TTFT p90 ms": pct(ttft, 90),
        "latency mean ms": statistics.fmean(latency),
        "latency p90 ms": pct(latency, 90),
        "req/s": len(samples) / wall_s,
    }


def prefix_row(prefill_records: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Affinity of each system prompt to a prefill engine (see the module docstring)."""
    arrivals = sorted(
        (r["received_at"], engine, str(r["body"]["prompt"]).split(":", 1)[0])
        for engine, records in prefill_records.items()
        for r in records
    )
    last: dict[str, str] = {}
    reached: dict[str, set[str]] = defaultdict(set)
    hits = 0
    for _, engine, group in arrivals:
        hits += last.get(group) == engine
        last[group] = engine
        reached[group].add(engine)
    repeats = len(arrivals) - len(last)
    busiest = max(Counter(engine for _, engine, _ in arrivals).values())
    return {
        "affinity %": 100 * hits / max(repeats, 1),
        "P per prompt": statistics.fmean(len(s) for s in reached.values()),
        "busiest P %": 100 * busiest / len(arrivals),
    }


async def run_policy(
    scenario: Scenario,
    policy: str,
    pools: tuple[list[EngineHandle], list[EngineHandle]],
    prompts: list[str],
    concurrency: int,
) -> dict[str, float]:
    prefills, decodes = pools
    cfg = ephemeral_config([address(e) for e in prefills], [address(e) for e in decodes])
    cfg[scenario.role] |= {"load_interval_s": 0.5} | pool_options(policy)
    timeout = aiohttp.ClientTimeout(total=120)
    async with running_sidecar(cfg) as sidecar, aiohttp.ClientSession(timeout=timeout) as http:
        await clear(http, [*prefills, *decodes])
        started = time.perf_counter()
        samples = await closed_loop(http, sidecar.url, prompts, concurrency)
        row = latency_row(samples, time.perf_counter() - started)
        if scenario.watch is not None:
            column, index = scenario.watch
            row[column] = 100 * len(await served(http, decodes[index])) / len(samples)
        if scenario.groups:
            row = {"TTFT mean ms": row["TTFT mean ms"]}
            row |= prefix_row({address(p): await served(http, p) for p in prefills})
    return row


async def run_scenario(
    scenario: Scenario, requests: int, concurrency: int
) -> dict[str, dict[str, float]]:
    rng = random.Random(42)
    prompts = [prompt_for(scenario, i, rng) for i in range(requests)]
    rows: dict[str, dict[str, float]] = {}
    async with engines(scenario) as pools, aiohttp.ClientSession() as http:
        load = [
            asyncio.create_task(keep_busy(http, pools[1][0])) for _ in range(scenario.external_load)
        ]
        try:
            await asyncio.sleep(2 if load else 0)  # let the outside queue build up
            for policy in scenario.policies:
                rows[policy] = await run_policy(scenario, policy, pools, prompts, concurrency)
                print(f"  {scenario.name} / {policy}: {format_row(rows[policy])}", flush=True)
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
    return rows


def format_row(row: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in row.items())


def markdown(name: str, rows: dict[str, dict[str, float]], policy_of: str) -> str:
    columns = list(next(iter(rows.values())))
    lines = [
        f"### {name} ({policy_of}.policy varied)",
        "",
        "| policy | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for policy, row in rows.items():
        lines.append(f"| {policy} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    chosen: Callable[[Scenario], bool] = lambda s: not args.only or s.name in args.only  # noqa: E731
    scenarios, notes = (__doc__ or "").split("\n\n")[1:3]
    sections = [
        f"# Picking policies: 2P2D vllmsim (default costs), {args.requests} requests per row, "
        f"concurrency {args.concurrency}, 64 output tokens",
        "",
        "```text",
        textwrap.dedent(scenarios),
        "```",
        "",
        " ".join(notes.split()),
    ]
    for scenario in filter(chosen, SCENARIOS):
        print(f"{scenario.name}:", flush=True)
        rows = await run_scenario(scenario, args.requests, args.concurrency)
        sections += ["", markdown(scenario.name, rows, scenario.role)]
    report = "\n".join(sections) + "\n"
    print("\n" + report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policies.md").write_text(report)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else "")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--only", nargs="*", help="scenario names")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args()


if __name__ == "__main__":
    run_bench(main(parse_args()))
