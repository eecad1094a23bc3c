#!/usr/bin/env python3
"""Median TTFT of every configuration side by side on the same vllmsim engines (PR #187's plan).

For each topology (1P1D, 2P2D) the harness starts push engines and pull engines, then
vllm-router 0.1.17 and pd-extproc in pull, serial-push and push modes, all at once, and runs
`vllm bench serve` (random 1024 in / 64 out, 2 × C prompts at concurrency C, warm-ups) over
every configuration, interleaved per (run, concurrency) so drift hits them alike. Output:
bench/results/ttft.md (table, ratios to vllm-router, targets), ttft.json (every run), ttft.png.

    python bench/run.py                 # full: C = 1..64, 3 runs (more at low C), 1P1D and 2P2D
    python bench/run.py --quick         # a few minutes: C = 1, 4, 16, 1 run, 1P1D
    python bench/run.py --concurrency 1,8,64 --runs 4 --topologies 2P2D
    python bench/run.py --profile gpu-8b --topologies 1P1D,4P4D   # engines' cost profile
    python bench/run.py --data-parallel-size 4 --concurrency 1,8,32,64   # DP ranks, see below

With `--data-parallel-size N` every engine is one API server over N ranks (`vllmsim -dp N`),
vllm-router runs with `--intra-node-data-parallel-size N`, pd-extproc learns the ranks from the
engines' /metrics; the default configs are vllm-router and push, and the outputs are
ttft-dpN.{md,json,png} with p50 and p99 side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report
from bench.client import Run, run_plan
from bench.engines import (
    DEV_MODE,
    Engines,
    lateness_delta,
    reset_prefix_caches,
    running_engines,
    step_lateness,
)
from bench.procs import ALL_CPUS, run_bench
from bench.targets import CONFIGS, ENGINE_KIND, Target, running_target
from scripts.cached_envs import tiny_model, vllm_router_venv
from vllmsim.profiles import DEFAULT_PROFILE, PROFILES

MODEL = "tiny"  # the served name the client asks for
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_split(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(engines and client, proxies): the proxy under test gets the last CPU to itself, so it
    never waits behind the simulated GPUs or the client; both proxies get the same placement."""
    if not pin or len(ALL_CPUS) < 2:
        return None, None
    return ALL_CPUS - {max(ALL_CPUS)}, {max(ALL_CPUS)}


def runs_at(conc: int, runs: int, min_requests: int) -> int:
    """At low C a run is only 2 × C requests, and a median of a handful is noise: more runs
    there (they are short), so that every cell pools at least `min_requests` requests."""
    return max(runs, math.ceil(min_requests / (2 * conc)))


def plan(
    topology: str,
    targets: dict[str, Target],
    concurrencies: list[int],
    runs: int,
    min_requests: int,
    work: Path,
    num_warmups: int | None = None,
) -> list[Run]:
    """Interleaved: run 0 of every (C, config), then run 1, ...; the config order rotates."""
    names = list(targets)
    out = []
    for index in range(max(runs_at(c, runs, min_requests) for c in concurrencies)):
        for conc in concurrencies:
            if index >= runs_at(conc, runs, min_requests):
                continue
            shift = (index + conc) % len(names)
            for name in names[shift:] + names[:shift]:
                run_id = f"{topology}-{name}-c{conc}-r{index}"
                out.append(
                    Run(
                        run_id,
                        topology,
                        name,
                        conc,
                        index,
                        targets[name].url,
                        work / f"{run_id}.json",
                        num_warmups=num_warmups,
                    )
                )
    return out


def data_parallel_flags(size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every engine's, vllm-router's) flags for `size` ranks per engine.

    The plan runs the same seeds, so the same prompts, through every configuration; each run
    starts on empty prefix caches (`between`), whose warm-ups then cache the first prompt as
    in the PR. With ranks the engines' prefix cache is off besides, so that a run's prompt
    never depends on a rank choice that sends it back to the rank that computed it.
    The router refuses DP routing without an API key; the engines ask for none, so any key
    does."""
    if size == 1:
        return (), ()
    return ("--data-parallel-size", str(size), "--no-enable-prefix-caching"), (
        "--intra-node-data-parallel-size",
        str(size),
        "--api-key",
        "bench",
    )


async def bench_topology(topology: str, args: argparse.Namespace, work: Path) -> list[dict]:
    n = int(topology[0])
    engine_cpus, proxy_cpus = cpu_split(args.pin)
    tokenizer, router = tiny_model(), vllm_router_venv() / "bin" / "vllm-router"
    engine_dp, router_dp = data_parallel_flags(args.data_parallel_size)
    async with contextlib.AsyncExitStack() as stack:
        engines: dict[str, Engines] = {}
        for kind in sorted({ENGINE_KIND[c] for c in args.configs}):
            engines[kind] = await stack.enter_async_context(
                running_engines(
                    kind,
                    n,
                    n,
                    MODEL,
                    tokenizer,
                    ("--profile", args.profile, *engine_dp),
                    cpus=engine_cpus,
                    env=DEV_MODE,
                )
            )
        targets = {
            c: await stack.enter_async_context(
                running_target(c, engines[ENGINE_KIND[c]], router, proxy_cpus, router_dp)
            )
            for c in args.configs
        }
        runs = plan(
            topology,
            targets,
            args.concurrency,
            args.runs,
            args.min_requests,
            work,
            args.num_warmups,
        )
        print(f"{topology}: {len(runs)} runs over {', '.join(targets)}", flush=True)
        lateness: dict[str, dict] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            last: dict = {}

            async def between(done: str | None, upcoming: str | None) -> None:
                """Each run's step lateness: the engines' counters at its two ends; and each
                run starts on empty prefix caches, its warm-ups then filling them as in the PR."""
                nonlocal last
                now = await step_lateness(http, list(engines.values()))
                if done is not None:
                    lateness[done] = lateness_delta(now, last)
                if upcoming is not None:
                    await reset_prefix_caches(http, list(engines.values()))
                last = now

            results = await run_plan(runs, MODEL, tokenizer, work, engine_cpus, between)
    return [
        {
            "topology": r.topology,
            "config": r.config,
            "concurrency": r.concurrency,
            "index": r.index,
            "step_lateness": lateness.get(r.id),
            **_slim(results[r.id]),
        }
        for r in runs
    ]


def _slim(result: dict) -> dict:
    """The scalar metrics, plus per-request TTFT and TPOT (ms) so cells can pool all runs.

    TPOT is the client's own definition: (latency - TTFT) / (output tokens - 1).
    """
    slim = {k: v for k, v in result.items() if isinstance(v, int | float | str) and k != "date"}
    per_request = zip(
        result.get("ttfts", []),
        result.get("latencies", []),
        result.get("output_lens", []),
        result.get("errors", []),
        strict=False,
    )
    done = [(t, lat, n) for t, lat, n, err in per_request if not err and n]
    slim["ttfts_ms"] = [round(t * 1e3, 3) for t, _, _ in done]
    slim["tpots_ms"] = [round((lat - t) / (n - 1) * 1e3, 3) for t, lat, n in done if n > 1]
    return slim


def write_outputs(records: list[dict], args: argparse.Namespace, meta: dict) -> None:
    table = report.cells(records)
    dp = args.data_parallel_size
    lines = [
        f"# Median TTFT (ms), vllmsim engines (profile {args.profile}"
        + (f", {dp} data-parallel ranks per engine" if dp > 1 else "")
        + "), input 1024 / output 64, prompts = 2 × C",
        "",
        f"{meta['when']}; {args.runs} run(s) per cell, more at low C so that a cell "
        f"has at least {args.min_requests} requests; cell = median TTFT of all the "
        f"cell's requests (runs pooled); {meta['duration_s']:.0f} s; load average before "
        f"{meta['load_before']}, after {meta['load_after']}; pinning: {meta['pinning']}; "
        f"commit {meta['commits']}.",
        "",
    ]
    for topology in args.topologies:
        lines += [f"## {topology}" + (f", DP = {dp} on each side" if dp > 1 else ""), ""]
        if dp > 1:
            lines += [*report.p50_p99_table(table, topology, args.concurrency), ""]
            lines += ["Target:", *report.ratio_checks(table, topology, args.concurrency), ""]
        else:
            lines += [*report.ttft_table(table, topology, args.configs, args.concurrency), ""]
            lines += ["Targets:", *report.target_checks(table, topology, args.concurrency), ""]
        lines += [
            "<details><summary>p99 TTFT, TPOT</summary>",
            "",
            *report.detail_table(table, topology, args.configs, args.concurrency),
            "",
            "</details>",
            "",
        ]
    stem = "ttft" if dp == 1 else f"ttft-dp{dp}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "runs": records}, indent=1))
    engines = "vllmsim engines" + (f" of {dp} DP ranks" if dp > 1 else "")
    report.plot(
        table, args.topologies, args.configs, args.concurrency, args.out / f"{stem}.png", engines
    )
    print("\n".join(lines))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="C = 1,4,16, 1 run, 1P1D")
    parser.add_argument("--concurrency", help="comma list (default 1,2,4,...,64)")
    parser.add_argument("--runs", type=int, help="runs per cell (default 3)")
    parser.add_argument(
        "--min-requests",
        type=int,
        help="add runs at low C until a cell pools this many requests (default 48)",
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        help="warm-up requests per run (default: C, within 2..8; PR #187 used 8)",
    )
    parser.add_argument("--topologies", help="comma list of nPnD (default 1P1D,2P2D)")
    parser.add_argument(
        "--configs", help=f"comma list (default {','.join(CONFIGS)}; with DP: vllm-router,push)"
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine ranks behind each engine's one port (vllmsim -dp N; default 1)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin engines and proxies to separate CPUs",
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        choices=sorted(PROFILES),
        help=f"the engines' cost profile (vllmsim/profiles.py; default {DEFAULT_PROFILE})",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    quick = args.quick
    args.concurrency = [
        int(c) for c in (args.concurrency or ("1,4,16" if quick else "1,2,4,8,16,32,64")).split(",")
    ]
    args.runs = args.runs or (1 if quick else 3)
    if args.min_requests is None:
        args.min_requests = 0 if quick else 48
    one_topology = quick or args.data_parallel_size > 1
    args.topologies = (args.topologies or ("1P1D" if one_topology else "1P1D,2P2D")).split(",")
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be at least 1")
    dp_configs = "vllm-router,push" if args.data_parallel_size > 1 else ",".join(CONFIGS)
    args.configs = (args.configs or dp_configs).split(",")
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    return args


def commit() -> str:
    """HEAD, marked dirty when extproc/ has uncommitted changes (the tree is shared)."""

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", *argv],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=RESULTS.parents[1],
            check=False,
        ).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (
        " (extproc/ dirty)" if git("status", "--porcelain", "--", "extproc") else ""
    )


async def main() -> None:
    args = parse_args()
    started, load_before = time.monotonic(), os.getloadavg()
    commits = [commit()]
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        for topology in args.topologies:
            records += await bench_topology(topology, args, Path(tmp))
            commits.append(commit())
    engine_cpus, proxy_cpus = cpu_split(args.pin)
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "duration_s": time.monotonic() - started,
        "load_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "pinning": f"engines and client on CPU {sorted(engine_cpus)}, proxies on CPU "
        f"{sorted(proxy_cpus or ())}"
        if engine_cpus
        else "none",
        "argv": sys.argv[1:],
        "commits": " → ".join(dict.fromkeys(commits)),
    }
    write_outputs(records, args, meta)


if __name__ == "__main__":
    run_bench(main())
