"""Calibrate vllmsim against real vLLM (CPU) and check the GPU profile against PR #187's rows.

1. CPU: the requests bench/calibrate_real.py sent to real vLLM CPU engines (its JSON: same
   prompts, same concurrency, same pd-extproc modes; measured first only when it is missing)
   are replayed on vllmsim engines with the `cpu-tiny` profile; per cell: real and simulated
   median TTFT, sim / real, and each mode's ratio to pull, real and simulated.
2. GPU, the cost model: the default profile (fitted to PR #187 with bench/fit.py) on
   the lab's virtual clock (bench/pr187.py's plan) at the PR's rows and between them
   (C = 4, 16, 64).
3. GPU, the processes: bench/run.py's plan (random 1024 in / 64 out, 2 x C prompts, 4P4D behind
   pd-extproc) against the PR's rows: best mean TTFT of the runs, the order of the modes, each
   ratio to pull within ±15 %, absolute within ±15 % up to C = 32; a row whose engines' steps ran
   late against their cost model is marked not faithful instead.

Writes bench/results/calibration.md and calibration.png and prints the tables.

    python bench/calibrate_real.py        # once: real engines (~5 min, needs the cached venv)
    python bench/calibrate.py             # the simulator's side and the comparison
    python bench/calibrate.py --skip-gpu  # CPU part only
    python bench/calibrate.py --skip-processes  # CPU part and the GPU cost model only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import pr187  # noqa: E402
from bench.calibrate_real import CONCURRENCY, FRONTS, ROUNDS  # noqa: E402
from bench.engines import running_engines  # noqa: E402
from bench.pr187 import MODES  # noqa: E402
from bench.procs import run_bench  # noqa: E402
from bench.real_vllm import Load, over_url, samples  # noqa: E402
from extproc.testing import ephemeral_config, running_sidecar  # noqa: E402
from scripts.cached_envs import tiny_model  # noqa: E402
from vllmsim.profiles import DEFAULT_PROFILE, PROFILES  # noqa: E402

RESULTS = ROOT / "bench" / "results"
FIT_CONCURRENCY = (1, 8, 32, 128)  # PR #187's rows this machine attempts (512: see the doc)
OFF_FIT_CONCURRENCY = (4, 16, 64)  # no PR row: the profile checked between its rows
# A cell is "not faithful" when the simulated engines' steps ran later than their cost model
# by more than this on average, or when more than LATE_TAIL_SHARE of them ran more than
# LATE_TAIL_MS late: the machine's CPU, not the model, then sets part of the TTFT.
LATE_MEAN_MS = 1.0
LATE_TAIL_MS = 10.0
LATE_TAIL_SHARE = 0.01


@contextlib.asynccontextmanager
async def sim_fronts(kind: str, load: Load) -> AsyncIterator[dict[str, Any]]:
    """vllmsim P and D with the cpu-tiny profile behind pd-extproc, one sidecar per mode."""
    async with contextlib.AsyncExitStack() as stack:
        engines = await stack.enter_async_context(
            running_engines(kind, 1, 1, "tiny", tiny_model(), ("--profile", "cpu-tiny"))
        )
        p = SimpleNamespace(address=engines.addresses("prefill")[0])
        d = SimpleNamespace(address=engines.addresses("decode")[0])
        asks = {}
        for name, mode in FRONTS[kind]:
            config = ephemeral_config(
                [p.address], [d.address], dispatch={"mode": mode}, envoy={"concurrency": 1}
            )
            handle = await stack.enter_async_context(running_sidecar(config, log_level="WARNING"))
            asks[name] = over_url(handle.url, load)
        yield asks


async def simulate_cpu(real: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """The real run's requests (prompts by seed, concurrency, rounds) on the simulator."""
    load = Load(real["requests"], real["prompt_words"], real["max_tokens"])
    sessions = int(real.get("sessions", 1))
    per_round = max(1, load.requests // (ROUNDS * sessions))
    names = [n for fronts in FRONTS.values() for n, _ in fronts]
    cells: dict[str, dict[str, list[float]]] = {}
    for kind in FRONTS:
        async with sim_fronts(kind, load) as asks:
            for session in range(sessions):
                for index, concurrency in enumerate(CONCURRENCY):
                    for round_ in range(ROUNDS):
                        for name, ask in asks.items():
                            seed = (
                                10_000 * session + 1000 * names.index(name) + 100 * index + round_
                            )
                            got = await samples(
                                ask, concurrency, per_round, load.prompt_words, seed
                            )
                            cells.setdefault(name, {}).setdefault(str(concurrency), []).extend(
                                round(t * 1e3, 3) for t in got
                            )
    return cells


def histograms(text: str) -> dict[str, float]:
    """`vllm:<name>_sum` / `_count` values of a /metrics text, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def engine_means(real: dict[str, Any]) -> dict[str, float]:
    """Per-request means (ms, or tokens) over every session of the real run, from the engines'
    own histograms: what the cpu-tiny profile's values are taken from."""
    wanted = {
        "P": (
            "request_prefill_time_seconds",
            "time_to_first_token_seconds",
            "request_prefill_kv_computed_tokens",
            "nixl_xfer_time_seconds",
        ),
        "D": ("inter_token_latency_seconds", "nixl_xfer_time_seconds"),
    }
    sums: dict[str, list[float]] = {}
    for sessions in real["metrics"].values():
        for session in sessions:
            for role, names in wanted.items():
                before = histograms(session["before"][role])
                after = histograms(session["after"][role])
                for name in names:
                    n = after.get(f"vllm:{name}_count", 0) - before.get(f"vllm:{name}_count", 0)
                    total = after.get(f"vllm:{name}_sum", 0) - before.get(f"vllm:{name}_sum", 0)
                    if n > 0:
                        scale = 1e3 if name.endswith("_seconds") else 1.0
                        sums.setdefault(f"{role} {name}", []).append(scale * total / n)
    return {key: statistics.fmean(values) for key, values in sums.items()}


def fit_lines(means: dict[str, float]) -> list[str]:
    step = means["D inter_token_latency_seconds"]
    prefill = means["P request_prefill_time_seconds"]
    tokens = means["P request_prefill_kv_computed_tokens"]
    overhead = means["P time_to_first_token_seconds"] - prefill
    profile = PROFILES["cpu-tiny"]
    rows = [
        ("step_base_ms", step, profile.step_base_ms),
        ("prefill_per_token_ms", (prefill - step) / tokens, profile.prefill_per_token_ms),
        ("api_overhead_ms", overhead, profile.api_overhead_ms),
    ]
    lines = ["| engine metric (mean per request over the sessions) | value |", "|---|---|"]
    lines += [f"| {key} | {value:.2f} |" for key, value in sorted(means.items())]
    lines += [
        "",
        "| cpu-tiny parameter | from the metrics | in vllmsim/profiles.py |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {fitted:.3f} | {value} |" for name, fitted, value in rows]
    return lines


def medians(cells: dict[str, dict[str, list[float]]]) -> dict[str, dict[int, float]]:
    return {
        name: {int(c): statistics.median(v) for c, v in row.items()} for name, row in cells.items()
    }


def cpu_table(real: dict[str, dict[int, float]], sim: dict[str, dict[int, float]]) -> list[str]:
    lines = [
        "| mode | c | real ms | sim ms | sim / real | real ratio to pull | "
        "sim ratio to pull | ratio error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        for c in CONCURRENCY:
            r, s = real[mode][c], sim[mode][c]
            rr, sr = r / real["pull"][c], s / sim["pull"][c]
            lines.append(
                f"| {mode} | {c} | {r:.1f} | {s:.1f} | {s / r:.2f} | {rr:.2f} | "
                f"{sr:.2f} | {sr / rr - 1:+.0%} |"
            )
    return lines


def run_gpu_plan(out: Path, runs: int, concurrency: tuple[int, ...], profile: str) -> None:
    """bench/run.py on 4P4D with the fitted profile, `runs` runs per C (writes out/ttft.json)."""
    argv = [
        sys.executable,
        str(ROOT / "bench" / "run.py"),
        "--profile",
        profile,
        "--topologies",
        "4P4D",
        "--configs",
        "pull,serial-push,push",
        "--concurrency",
        ",".join(map(str, concurrency)),
        "--runs",
        str(runs),
        "--min-requests",
        "0",
        "--num-warmups",
        str(pr187.WARMUPS),
        "--out",
        str(out),
    ]
    subprocess.run(argv, check=True, timeout=3600)


@dataclass(frozen=True)
class Cell:
    """One (mode, C) of the real-process run: its best run's mean TTFT, as PR #187 reports a
    cell, and the step lateness of all its runs pooled."""

    best_mean_ms: float
    late_mean_ms: float  # mean lateness per engine step
    late_tail: float  # share of steps more than LATE_TAIL_MS late

    @property
    def faithful(self) -> bool:
        return self.late_mean_ms <= LATE_MEAN_MS and self.late_tail <= LATE_TAIL_SHARE


def gpu_cells(out: Path) -> dict[str, dict[int, Cell]]:
    records = json.loads((out / "ttft.json").read_text())["runs"]
    grouped: dict[tuple[str, int], list[dict]] = {}
    for rec in records:
        key = (rec["config"].replace("-", "_"), rec["concurrency"])
        grouped.setdefault(key, []).append(rec)
    cells: dict[str, dict[int, Cell]] = {}
    for (mode, c), recs in grouped.items():
        ok = [r for r in recs if r.get("completed") and not r.get("failed")]
        late = [r["step_lateness"] for r in recs if r.get("step_lateness")]
        steps = sum(x["steps"] for x in late) or 1
        tail = sum(n for x in late for le, n in x["buckets_ms"].items() if float(le) > LATE_TAIL_MS)
        cells.setdefault(mode, {})[c] = Cell(
            min(r["mean_ttft_ms"] for r in ok) if ok else math.nan,
            1e3 * sum(x["late_s"] for x in late) / steps,
            tail / steps,
        )
    return cells


def _check(sim: dict[str, float], ref: dict[str, float], c: int) -> list[str]:
    """What misses the aim in one row: the order, a ratio to pull, an absolute figure."""
    misses = []
    if pr187.order(sim) != pr187.order(ref):
        misses.append(f"order {pr187.order(sim)} (PR {pr187.order(ref)})")
    sim_r, ref_r = pr187.ratios(sim), pr187.ratios(ref)
    for m in MODES[1:]:
        if abs(sim_r[m] / ref_r[m] - 1) > pr187.TOLERANCE:
            misses.append(f"{m}/pull {sim_r[m]:.2f} (PR {ref_r[m]:.2f})")
    if c <= pr187.ABSOLUTE_UP_TO:
        for m in MODES:
            if abs(sim[m] / ref[m] - 1) > pr187.TOLERANCE:
                misses.append(f"{m} {sim[m]:.0f} ms (PR {ref[m]:.0f})")
    return misses


def _row_cells(c: int, sim: dict[str, float], ref: dict[str, float]) -> str:
    sim_r, ref_r = pr187.ratios(sim), pr187.ratios(ref)
    return (
        f"| {c} | "
        + " | ".join(f"{sim[m]:.0f} / {ref[m]:.0f} ({sim[m] / ref[m] - 1:+.0%})" for m in MODES)
        + " | "
        + " | ".join(f"{sim_r[m]:.2f} / {ref_r[m]:.2f}" for m in MODES[1:])
        + f" | {pr187.order(sim)} | {pr187.order(ref)} |"
    )


_HEAD = (
    "| C | pull: sim / PR ms | serial push: sim / PR | push: sim / PR | serial push / pull: "
    "sim / PR | push / pull: sim / PR | sim order | PR order |"
)


def gpu_table(cells: dict[str, dict[int, Cell]]) -> tuple[list[str], list[str]]:
    """The PR's rows against the real-process run; a cell whose engines ran late is no result."""
    lines = [
        _HEAD + " step lateness: mean ms, share > 10 ms | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    misses = []
    for c in sorted({c for row in cells.values() for c in row}):
        if c not in pr187.ROWS or any(c not in cells.get(m, {}) for m in MODES):
            continue
        row = {m: cells[m][c] for m in MODES}
        sim = {m: cell.best_mean_ms for m, cell in row.items()}
        late = max(cell.late_mean_ms for cell in row.values())
        tail = max(cell.late_tail for cell in row.values())
        if not all(cell.faithful for cell in row.values()):
            verdict = "not faithful"
            misses.append(f"C = {c}: not faithful (engines' steps {late:.1f} ms late on average)")
        else:
            found = _check(sim, pr187.ROWS[c], c)
            verdict = "; ".join(found) if found else "ok"
            misses += [f"C = {c}: {m}" for m in found]
        lines.append(_row_cells(c, sim, pr187.ROWS[c]) + f" {late:.2f}, {tail:.1%} | {verdict} |")
    return lines, misses


def virtual_table(profile: str, runs: int) -> tuple[list[str], list[str], dict]:
    """The cost model alone (bench/pr187.py's plan on the lab: the same engines in one process
    on a virtual clock, no HTTP, no CPU contention) at the PR's rows and between them."""
    cost = PROFILES[profile]
    concurrency = sorted({*FIT_CONCURRENCY, *OFF_FIT_CONCURRENCY})
    rows = pr187.table(cost, tuple(concurrency), runs=runs)
    lines = [_HEAD + " check |", "|---|---|---|---|---|---|---|---|---|"]
    misses = []
    for c in concurrency:
        ref = pr187.interpolated(c)
        found = _check(rows[c], ref, c)
        where = "fitted row" if c in pr187.ROWS else "between rows (PR interpolated log-log)"
        lines.append(_row_cells(c, rows[c], ref) + f" {where}: {'; '.join(found) or 'ok'} |")
        misses += [f"C = {c} ({where}): {m}" for m in found]
    for m in MODES:
        values = [rows[c][m] for c in concurrency]
        if any(b < a for a, b in itertools.pairwise(values)):
            misses.append(f"{m}: TTFT not monotone in C ({', '.join(f'{v:.0f}' for v in values)})")
    return lines, misses, rows


def plot(
    real: dict[str, dict[int, float]],
    sim: dict[str, dict[int, float]],
    gpu: dict[str, dict[int, float]],
    virtual: dict[int, dict[str, float]],
    path: Path,
) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    left, right = axes[0]
    for index, mode in enumerate(MODES):
        cs = list(CONCURRENCY)
        left.plot(
            cs, [real[mode][c] for c in cs], "o-", color=f"C{index}", label=f"{mode} real vLLM"
        )
        left.plot(
            cs,
            [sim[mode][c] for c in cs],
            "s--",
            color=f"C{index}",
            label=f"{mode} vllmsim cpu-tiny",
        )
    left.set_title("1P1D, tiny model on this CPU: real vs simulated")
    left.set_xlabel("concurrency")
    left.set_ylabel("median TTFT (ms)")
    for index, mode in enumerate(MODES):
        ref = sorted(pr187.ROWS)
        right.plot(
            ref,
            [pr187.ROWS[c][mode] for c in ref],
            "o",
            color=f"C{index}",
            markersize=9,
            label=f"{mode} PR #187",
        )
        cs = sorted(virtual)
        right.plot(
            cs,
            [virtual[c][mode] for c in cs],
            ":",
            color=f"C{index}",
            label=f"{mode} cost model (virtual clock)",
        )
        if gpu.get(mode):
            cs = sorted(gpu[mode])
            right.plot(
                cs,
                [gpu[mode][c] for c in cs],
                "s--",
                color=f"C{index}",
                label=f"{mode} vllmsim processes",
            )
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_title(f"4P4D, {DEFAULT_PROFILE} vs PR #187: best mean TTFT of the runs")
    right.set_xlabel("concurrency")
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def real_recording(path: Path) -> dict[str, Any]:
    """bench/calibrate_real.py's JSON; only when it is missing are real engines started."""
    if not path.exists():
        print(f"{path} is missing: measuring real vLLM (bench/calibrate_real.py, ~5 min)")
        argv = [sys.executable, str(ROOT / "bench" / "calibrate_real.py"), "--out", str(path)]
        subprocess.run(argv, check=True, timeout=3600)
    return dict(json.loads(path.read_text()))


async def gpu_lines(
    args: argparse.Namespace,
) -> tuple[list[str], dict[str, dict[int, float]], dict[int, dict[str, float]]]:
    lines, misses = [], []
    virtual, processes = {}, {}
    if not args.skip_gpu:
        # its own event loop (a virtual clock), so in a thread of its own
        table, misses_v, virtual = await asyncio.to_thread(
            virtual_table, DEFAULT_PROFILE, args.gpu_runs
        )
        lines += [
            f"## GPU: the `{DEFAULT_PROFILE}` cost model vs PR #187 (virtual clock)",
            "",
            "bench/pr187.py's plan on the lab (docs/lab.md): pd-extproc's scheduler (round "
            "robin) before the simulator's engines and connectors in one process, the proxy "
            "a fixed 0.3 ms hop, no CPU contention; best mean TTFT of "
            f"{args.gpu_runs} runs. Rows 4, 16 and 64 are not in the PR: they are checked "
            "against the PR's curve interpolated log-log between its neighbouring rows, and "
            "every mode's TTFT must grow with C.",
            "",
            *table,
            "",
            "Misses: " + ("; ".join(misses_v) if misses_v else "none"),
            "",
        ]
    cells = None
    if args.gpu_results:
        cells = gpu_cells(args.gpu_results)
    elif not args.skip_gpu and not args.skip_processes:
        with tempfile.TemporaryDirectory(prefix="calibrate-gpu-") as tmp:
            run_gpu_plan(Path(tmp), args.gpu_runs, FIT_CONCURRENCY, DEFAULT_PROFILE)
            cells = gpu_cells(Path(tmp))
    if cells:
        table, misses = gpu_table(cells)
        processes = {
            m: {c: cell.best_mean_ms for c, cell in row.items()} for m, row in cells.items()
        }
        lines += [
            f"## GPU: vllmsim processes (`{DEFAULT_PROFILE}`, 4P4D behind pd-extproc) vs PR #187",
            "",
            f"bench/run.py's plan, {args.gpu_runs} runs per C, best run's mean TTFT. A row is "
            f"not faithful when the engines' steps ran more than {LATE_MEAN_MS:g} ms late on "
            f"average or more than {LATE_TAIL_SHARE:.0%} of them more than {LATE_TAIL_MS:g} ms "
            "late (GET /sim/state's step_lateness, per run).",
            "",
            *table,
            "",
            "Misses: " + ("; ".join(misses) if misses else "none"),
            "",
        ]
    return lines, processes, virtual


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", type=Path, default=RESULTS / "calibration_real.json")
    parser.add_argument("--skip-gpu", action="store_true")
    parser.add_argument(
        "--skip-processes",
        action="store_true",
        help="GPU: the cost model on a virtual clock only, not the 4P4D processes",
    )
    parser.add_argument("--gpu-runs", type=int, default=4, help="runs per C (PR #187: best of 4)")
    parser.add_argument(
        "--gpu-results",
        type=Path,
        help="a directory where bench/run.py already wrote this plan's ttft.json",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started, load_before = time.monotonic(), os.getloadavg()
    real_raw = real_recording(args.real)
    real = medians(real_raw["cells"])
    sim = medians(await simulate_cpu(real_raw))
    gpu, processes, virtual = await gpu_lines(args)
    lines = [
        "# vllmsim calibration",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `python bench/calibrate.py"
        f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`; load average "
        f"{' '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end.",
        "",
        "## CPU: real vLLM vs vllmsim `cpu-tiny` (1P1D, pd-extproc in front)",
        "",
        f"Real: vLLM {real_raw['vllm']}, measured {real_raw['when']} "
        f"({real_raw['requests']} requests per cell, ~{real_raw['prompt_words']}-word "
        f"prompts = {real_raw.get('prompt_tokens', '?')} tokens, {real_raw['max_tokens']} "
        "output tokens). Median TTFT at the client.",
        "",
        *cpu_table(real, sim),
        "",
        "The profile's fitted values:",
        "",
        *fit_lines(engine_means(real_raw)),
        "",
        *gpu,
        f"Took {time.monotonic() - started:.0f} s.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.md").write_text(text)
    plot(real, sim, processes, virtual, args.out / "calibration.png")


if __name__ == "__main__":
    run_bench(main())
