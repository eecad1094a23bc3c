"""The routing candidates against round robin on the lab's matrix (issue 37's defaults).

Every cell is one topology, one workload at one load and one count of ext_proc processes
(`--workers`), run on the lab (virtual time, so every figure comes back identical) once per
configuration; the table gives each candidate's TTFT p50 and p99 and TPOT p99 over round
robin's of the same cell. A ratio over 1.02 is a miss (bold); on shared-prefix and multi-turn
the aim is TTFT at most 0.7 x round robin's (the approximate mode: p50 at most 0.8 x).

Configurations (push dispatch in all):
- `round_robin`: round robin on both pools, no KV awareness;
- `kv_events`: `kv_cache` on both pools fed by the engines' KV events, `decision: load_aware`
  (what the default would be with engines that publish events);
- `approximate`: `kv_cache` on both pools with neither events nor a tokenizer, so the
  sidecar's memory of what it routed where stands in (the default without engine flags).

Loads are closed loops at C = `--per-prefill` x the prefill engines (light, medium, saturated
by default); the trace is a generated Mooncake-format one (`bench/lab_scale.py`'s) replayed
open loop at the same three rates per prefill engine.

    python bench/lab_matrix.py                          # the whole matrix, 2 processes
    python bench/lab_matrix.py --topologies 2P2D --workloads shared-prefix --workers 1
    python bench/lab_matrix.py --write                  # also bench/results/lab-matrix.md

Each lab run is a process of its own under `nice`, `--jobs` at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lab_scale import write_trace  # noqa: E402
from lab.engines import parse_topology  # noqa: E402
from lab.run import Settings, run_config  # noqa: E402
from lab.tokenizer import TokenizerCosts  # noqa: E402
from lab.workloads import generate, read_mooncake  # noqa: E402
from vllmsim.profiles import DEFAULT_PROFILE, PROFILES  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "lab-matrix.md"
BASELINE = "round_robin"
_POOLS = "prefill: {{{0}endpoints: [127.0.0.1:8100]}}\ndecode: {{{0}endpoints: [127.0.0.1:8200]}}\n"
CONFIGS = {
    "round_robin": "dispatch: {mode: push}\ndecision: {mode: off}\n"
    + _POOLS.format("policy: round_robin, "),
    "kv_events": (
        "dispatch: {mode: push}\ndecision: {mode: load_aware}\ntokenizer: tokenizer.json\n"
        + _POOLS.format("policy: kv_cache, kv_events: {port: 5557}, ")
    ),
    "approximate": (
        "dispatch: {mode: push}\ndecision: {mode: load_aware}\n"
        + _POOLS.format("policy: kv_cache, ")
    ),
}
CACHE_WORKLOADS = ("shared-prefix", "multi-turn")
MISS_OVER = 1.02


@dataclass(frozen=True)
class Cell:
    topology: str
    workload: str
    per_prefill: float  # clients (closed loop) or requests per second (trace) per P engine
    workers: int

    @property
    def label(self) -> str:
        load = "rate" if self.workload == "trace" else "C"
        return f"{self.topology} {self.workload} {load}={self.load:g} W={self.workers}"

    @property
    def load(self) -> float:
        return self.per_prefill * parse_topology(self.topology).prefill


def _requests(cell: Cell) -> int:
    """Enough for a p99 to mean something: 8 x C, at least 256 (multi-turn: whole
    conversations of 6 turns). The seed plan twice that: its closed loop of equal prompts
    settles into a staircase of TTFTs (0, 1 or 2 prompts ahead at P), and at 8 requests a
    client its median fell on one step or the next by two requests of 256."""
    if cell.workload == "seed":
        return max(512, 16 * int(cell.load))
    count = max(256, 8 * int(cell.load))
    return count - count % 6 if cell.workload == "multi-turn" else count


def config_text(config: str, decision: str = "") -> str:
    """The configuration's YAML; `decision`: more `decision:` settings for the candidates
    that decide (`max_stall_ms: 15, ...`), to try them."""
    text = CONFIGS[config]
    if decision:
        text = text.replace("{mode: load_aware}", f"{{mode: load_aware, {decision}}}")
    return text


def run_cell(
    cell: Cell, config: str, seed: int, decision: str = "", tokenize: bool = False
) -> dict[str, Any]:
    """One configuration's summary on one cell (in a worker process)."""
    os.nice(19)
    with tempfile.TemporaryDirectory(prefix="lab-matrix-") as folder:
        path = Path(folder) / f"{config}.yaml"
        path.write_text(config_text(config, decision))
        requests = _requests(cell)
        if cell.workload == "trace":
            trace = Path(folder) / "trace.jsonl"
            write_trace(trace, requests, cell.load, seed)
            workload = read_mooncake(trace, 1.0, None)
        else:
            workload = generate(cell.workload, seed, int(cell.load), None, requests)
        settings = Settings(
            parse_topology(cell.topology),
            PROFILES[DEFAULT_PROFILE],
            seed=seed,
            workers=cell.workers,
            tokenizer=TokenizerCosts() if tokenize else None,
        )
        return run_config(path, workload, settings)


def mean_of_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One figure per percentile: the mean over the seeds' runs (a closed loop's phase moves
    with a single request decided otherwise, so one seed's p50 can move a few percent)."""

    def mean(key: str, q: str) -> float | None:
        values = [run[key][q] for run in runs]
        return None if None in values else sum(values) / len(values)

    means = [run["ttft_mean_ms"] for run in runs]
    return {
        "ttft_ms": {q: mean("ttft_ms", q) for q in ("p50", "p90", "p99")},
        "ttft_mean_ms": None if None in means else sum(means) / len(means),
        "tpot_ms": {q: mean("tpot_ms", q) for q in ("p50", "p99")},
        "failed": sum(run["failed"] for run in runs),
        "decode_only_share": sum(run["decode_only_share"] for run in runs) / len(runs),
    }


def _ratio(summary: dict[str, Any], base: dict[str, Any], key: str, q: str = "") -> float | None:
    mine, theirs = (summary[key][q], base[key][q]) if q else (summary[key], base[key])
    return None if not mine or not theirs else mine / theirs


def _fmt(ratio: float | None, aim: float | None = None) -> str:
    if ratio is None:
        return "n/a"
    text = f"{ratio:.2f}"
    missed = ratio > MISS_OVER or (aim is not None and ratio > aim)
    return f"**{text}**" if missed else text


def table(results: dict[Cell, dict[str, dict[str, Any]]], candidates: list[str]) -> list[str]:
    head = ["cell", "round robin TTFT p50 / p99 ms"]
    for name in candidates:
        head.append(f"{name}: TTFT p50 / p99 / mean, TPOT p99 ÷ rr")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell, by_config in results.items():
        base = by_config[BASELINE]
        row = [cell.label, f"{base['ttft_ms']['p50']:.0f} / {base['ttft_ms']['p99']:.0f}"]
        for name in candidates:
            summary = by_config[name]
            caches = cell.workload in CACHE_WORKLOADS
            aim = (0.8 if name == "approximate" else 0.7) if caches else None
            p99_aim = None if name == "approximate" else aim
            failed = f" ({summary['failed']} failed)" if summary["failed"] else ""
            row.append(
                " / ".join(
                    (
                        _fmt(_ratio(summary, base, "ttft_ms", "p50"), aim),
                        _fmt(_ratio(summary, base, "ttft_ms", "p99"), p99_aim),
                        _fmt(_ratio(summary, base, "ttft_mean_ms")),
                        _fmt(_ratio(summary, base, "tpot_ms", "p99")),
                    )
                )
                + failed
            )
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _cells(args: argparse.Namespace) -> list[Cell]:
    return [
        Cell(topology, workload, per_prefill, workers)
        for workers in args.workers
        for topology in args.topologies
        for workload in args.workloads
        for per_prefill in args.per_prefill
    ]


def _csv(kind: type) -> Any:
    return lambda text: [kind(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", type=_csv(str), default="1P1D,2P2D,4P4D,8P8D,16P16D")
    parser.add_argument(
        "--workloads", type=_csv(str), default="seed,shared-prefix,multi-turn,mixed,trace"
    )
    parser.add_argument("--per-prefill", type=_csv(float), default="1,4,16")
    parser.add_argument("--workers", type=_csv(int), default="1,4")
    parser.add_argument("--configs", type=_csv(str), default=",".join(CONFIGS))
    parser.add_argument(
        "--decision",
        default="",
        help="more decision settings for the candidates, e.g. 'max_stall_ms: 15'",
    )
    parser.add_argument("--seeds", type=_csv(int), default="1,2,3", help="figures: their mean")
    parser.add_argument(
        "--tokenize",
        action="store_true",
        help="prompts as text the sidecar tokenizes at the lab's default costs (docs/lab.md)",
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write every summary here")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args()
    configs = [BASELINE, *(c for c in args.configs if c != BASELINE)]
    started, load = time.monotonic(), os.getloadavg()
    cells = _cells(args)
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = {
            (cell, config): [
                pool.submit(run_cell, cell, config, seed, args.decision, args.tokenize)
                for seed in args.seeds
            ]
            for cell in cells
            for config in configs
        }
        runs: dict[Cell, dict[str, list[dict[str, Any]]]] = {}
        for (cell, config), by_seed in futures.items():
            runs.setdefault(cell, {})[config] = [future.result() for future in by_seed]
            print(f"{cell.label} {config}: done", file=sys.stderr, flush=True)
    results = {
        cell: {config: mean_of_seeds(seeds) for config, seeds in by_config.items()}
        for cell, by_config in runs.items()
    }
    lines = [
        "# Routing candidates against round robin on the lab's matrix",
        "",
        f"`python {' '.join(['bench/lab_matrix.py', *sys.argv[1:]])}`, profile "
        f"`{DEFAULT_PROFILE}`, the mean of seeds {args.seeds}, virtual time "
        f"({time.monotonic() - started:.0f} s of wall time, load average {load[0]:.1f} at "
        "the start). Each candidate's figure over "
        f"round robin's in the same cell; bold: over {MISS_OVER} or past the aim.",
        "",
        *table(results, configs[1:]),
        "",
    ]
    print("\n".join(lines))
    if args.json:
        flat = [
            {"cell": cell.label, "config": name, "seed": seed, **summary}
            for cell, by_config in runs.items()
            for name, by_seed in by_config.items()
            for seed, summary in zip(args.seeds, by_seed, strict=True)
        ]
        args.json.write_text(json.dumps(flat, indent=1))
    if args.write:
        RESULTS.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
