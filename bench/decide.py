#!/usr/bin/env python3
"""The decode-only decision against vllm-router and always-disaggregate, same run, same engines.

2P2D vllmsim push engines (default costs), four configurations started at once:

  decide      pd-extproc, push, decision.mode load_aware
  always      pd-extproc, push, always disaggregate
              (both: prefill policy least_tokens, decode policy least_request)
  router-rr   vllm-router 0.1.17, PD mode, round_robin (bench/run.py's setting)
  router-p2   vllm-router 0.1.17, PD mode, power_of_two
and two workloads: the seed's fixed random 1024 in / 64 out, and the seeded heavy-tailed one
of bench/workload.py. `vllm bench serve` runs 2 × C prompts at concurrency C, interleaved per
(run, C) with a rotating config order, as bench/run.py does. A cell pools every run's requests.
Targets: decide's TTFT p50 and p99 ≤ 0.90 × the better vllm-router's at every C; decide's TPOT
p99 ≤ 1.05 × always's. Output: bench/results/decide.md, decide.json, decide.png.

    python bench/decide.py                          # C = 1..64, 2 runs, ≥ 32 requests a cell
    python bench/decide.py --concurrency 1,8 --runs 1 --min-requests 0 --workloads fixed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from bench import report
from bench.client import Run, run_plan
from bench.engines import Engines, running_engines
from bench.procs import pinned, run_bench
from bench.run import MODEL, RESULTS, _slim, commit, cpu_split, runs_at
from bench.targets import Target, running_router
from bench.workload import heavy_tailed, summary, write
from extproc.testing import ephemeral_config, running_sidecar, scrape
from scripts.cached_envs import tiny_model, vllm_router_venv

CONFIGS = ("decide", "always", "router-rr", "router-p2")
ROUTERS = ("router-rr", "router-p2")
# The tiny model's tokenizer has 479 tokens: its prompts are ~2.75 JSON bytes per token (the
# workload file says so), not the ~4 of English text: the decision is calibrated to it.
DECISION = {"mode": "load_aware", "bytes_per_token": 2.75}


@contextlib.asynccontextmanager
async def running_pd_extproc(
    name: str, engines: Engines, cpus: set[int] | None, **sections: dict
) -> AsyncIterator[Target]:
    """pd-extproc in push mode, prefill policy least_tokens, decode policy least_request."""
    config = ephemeral_config(
        engines.addresses("prefill"),
        engines.addresses("decode"),
        dispatch={"mode": "push"},
        **sections,
    )
    config["decode"]["policy"] = "least_request"
    config["prefill"]["policy"] = "least_tokens"
    with pinned(cpus):
        runner = running_sidecar(config, log_level="WARNING")
        sidecar = await runner.__aenter__()
    try:
        yield Target(name, sidecar.url, sidecar.pid, sidecar.metrics, sidecar.envoy_admin)
    finally:
        await runner.__aexit__(None, None, None)


async def start_targets(
    stack: contextlib.AsyncExitStack, engines: Engines, proxy_cpus: set[int] | None
) -> dict[str, Target]:
    router = vllm_router_venv() / "bin" / "vllm-router"
    return {
        "decide": await stack.enter_async_context(
            running_pd_extproc("decide", engines, proxy_cpus, decision=DECISION)
        ),
        "always": await stack.enter_async_context(
            running_pd_extproc("always", engines, proxy_cpus)
        ),
        "router-rr": await stack.enter_async_context(
            running_router(engines, router, proxy_cpus, "round_robin", "router-rr")
        ),
        "router-p2": await stack.enter_async_context(
            running_router(engines, router, proxy_cpus, "power_of_two", "router-p2")
        ),
    }


def plan(
    workload: str,
    path: Path | None,
    targets: dict[str, Target],
    args: argparse.Namespace,
    work: Path,
) -> list[Run]:
    names, out = list(targets), []
    for index in range(max(runs_at(c, args.runs, args.min_requests) for c in args.concurrency)):
        for conc in args.concurrency:
            if index >= runs_at(conc, args.runs, args.min_requests):
                continue
            shift = (index + conc) % len(names)
            for name in names[shift:] + names[:shift]:
                run_id = f"{workload}-{name}-c{conc}-r{index}"
                out.append(
                    Run(
                        run_id,
                        workload,
                        name,
                        conc,
                        index,
                        targets[name].url,
                        work / f"{run_id}.json",
                        path,
                    )
                )
    return out


async def decision_counts(target: Target) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        metrics = await scrape(session, f"{target.metrics}/metrics")
    prefix = "pd_extproc_dispatch_decisions_total"
    return {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}


async def bench(args: argparse.Namespace, work: Path) -> tuple[list[dict], dict]:
    engine_cpus, proxy_cpus = cpu_split(args.pin)
    tokenizer = tiny_model()
    heavy = work / "heavy.jsonl"
    rows = heavy_tailed(tokenizer)
    write(heavy, rows)
    info: dict = {"heavy": summary(rows), "decisions": {}}
    records: list[dict] = []
    async with contextlib.AsyncExitStack() as stack:
        engines = await stack.enter_async_context(
            running_engines("push", 2, 2, MODEL, tokenizer, cpus=engine_cpus)
        )
        targets = await start_targets(stack, engines, proxy_cpus)
        for workload in args.workloads:
            before = await decision_counts(targets["decide"])
            runs = plan(workload, heavy if workload == "heavy" else None, targets, args, work)
            print(f"{workload}: {len(runs)} runs", flush=True)
            results = await run_plan(runs, MODEL, tokenizer, work, engine_cpus)
            after = await decision_counts(targets["decide"])
            info["decisions"][workload] = {k: v - before.get(k, 0) for k, v in after.items()}
            records += [
                {
                    "topology": r.topology,
                    "config": r.config,
                    "concurrency": r.concurrency,
                    "index": r.index,
                    **_slim(results[r.id]),
                }
                for r in runs
            ]
    return records, info


def _f(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def workload_section(
    table: dict, workload: str, concurrencies: list[int]
) -> tuple[list[str], list[str]]:
    """(the table lines, the misses)."""

    def get(config: str, conc: int, key: str) -> float | None:
        return table.get((workload, config, conc), {}).get(key)

    head = [
        "C",
        *(f"{c} p50 / p99 TTFT, p99 TPOT" for c in CONFIGS),
        "decide / best router p50",
        "decide / best router p99",
        "decide / always TPOT p99",
        "verdict",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    misses = []
    for conc in concurrencies:
        cells = [
            f"{_f(get(c, conc, 'median_ttft_ms'))} / {_f(get(c, conc, 'p99_ttft_ms'))}, "
            f"{_f(get(c, conc, 'p99_tpot_ms'), 2)}"
            for c in CONFIGS
        ]
        ratios = []
        for key in ("median_ttft_ms", "p99_ttft_ms"):
            mine = get("decide", conc, key)
            best = min((v for r in ROUTERS if (v := get(r, conc, key)) is not None), default=None)
            ratios.append(mine / best if mine and best else None)
        tpot, always = get("decide", conc, "p99_tpot_ms"), get("always", conc, "p99_tpot_ms")
        ratios.append(tpot / always if tpot and always else None)
        bad = [
            name
            for name, value, limit in zip(
                ("p50", "p99", "TPOT"), ratios, (0.90, 0.90, 1.05), strict=True
            )
            if value is None or value > limit
        ]
        if bad:
            misses.append(f"C={conc}: {', '.join(bad)}")
        verdict = "met" if not bad else "MISSED " + ", ".join(bad)
        lines.append(
            "| " + " | ".join([str(conc), *cells, *(_f(r, 2) for r in ratios), verdict]) + " |"
        )
    return lines, misses


def write_outputs(records: list[dict], info: dict, args: argparse.Namespace, meta: dict) -> None:
    table = report.cells(records)
    lines = [
        "# Decode-only decision: pd-extproc (decide) vs vllm-router vs always-disaggregate",
        "",
        "2P2D vllmsim push engines (default costs); `vllm bench serve`, 2 × C prompts at "
        f"concurrency C; {args.runs} run(s) per cell, more at low C so that a cell has at "
        f"least {args.min_requests} requests, pooled. {meta['when']}; {meta['duration_s']:.0f}"
        f" s; load average before {meta['load_before']}, after {meta['load_after']} (other "
        f"helpers were running on the machine); pinning: {meta['pinning']}; commit "
        f"{meta['commits']}. TTFT and TPOT in ms (TPOT: the client's (latency − TTFT) / "
        "(tokens − 1)). Best router: per cell, the lower of router-rr and router-p2.",
        "",
        f"Heavy-tailed workload (bench/workload.py, seed 14): {info.get('heavy', '')}.",
        "",
    ]
    for workload in args.workloads:
        section, misses = workload_section(table, workload, args.concurrency)
        lines += [
            f"## {workload}",
            "",
            *section,
            "",
            f"Decisions of `decide` over this workload: {info['decisions'].get(workload)}",
            "",
            "Misses: " + ("; ".join(misses) if misses else "none"),
            "",
        ]
        lines += [
            "<details><summary>every cell</summary>",
            "",
            *report.detail_table(table, workload, list(CONFIGS), args.concurrency),
            "",
            "</details>",
            "",
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decide.md").write_text("\n".join(lines))
    (args.out / "decide.json").write_text(
        json.dumps({"meta": meta, "info": info, "runs": records}, indent=1)
    )
    plot(table, args, args.out / "decide.png")
    print("\n".join(lines))


def plot(table: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        3, len(args.workloads), figsize=(6 * len(args.workloads), 11), squeeze=False
    )
    for column, workload in enumerate(args.workloads):
        for row, (key, label) in enumerate(
            (
                ("median_ttft_ms", "TTFT p50 (ms)"),
                ("p99_ttft_ms", "TTFT p99 (ms)"),
                ("p99_tpot_ms", "TPOT p99 (ms)"),
            )
        ):
            ax = axes[row][column]
            for index, config in enumerate(CONFIGS):
                points = [
                    (c, v)
                    for c in args.concurrency
                    if (v := table.get((workload, config, c), {}).get(key)) is not None
                ]
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=config, color=f"C{index}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
            if row < 2:
                ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.set_title(f"{workload}, 2P2D vllmsim")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        axes[2][column].set_xlabel("concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=32)
    parser.add_argument("--workloads", default="fixed,heavy")
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.workloads = args.workloads.split(",")
    return args


async def main() -> None:
    args = parse_args()
    started, load_before = time.monotonic(), os.getloadavg()
    commits = [commit()]
    with tempfile.TemporaryDirectory(prefix="bench-decide-") as tmp:
        records, info = await bench(args, Path(tmp))
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
    write_outputs(records, info, args, meta)


if __name__ == "__main__":
    run_bench(main())
