"""Calibrate vllmsim against real vLLM (CPU) and check the GPU profile against PR #187's rows.

1. CPU: the requests bench/calibrate_real.py sent to real vLLM CPU engines (its JSON: same
   prompts, same concurrency, same pd-extproc modes) are replayed on vllmsim engines with the
   `cpu-tiny` profile; per cell: real and simulated median TTFT, sim / real, and each mode's
   ratio to pull, real and simulated.
2. GPU: bench/run.py's plan (random 1024 in / 64 out, 2 x C prompts) on vllmsim engines with
   the `gpu-8b` profile, not refitted, against the rows of vllm-project/router PR #187 (4P/4D
   GPUs): the order of the modes at every C and each ratio within ±15 %.

Writes bench/results/calibration.md and calibration.png and prints the tables.

    python bench/calibrate_real.py        # once: real engines (~5 min, needs the cached venv)
    python bench/calibrate.py             # the simulator's side and the comparison
    python bench/calibrate.py --skip-gpu  # CPU part only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.calibrate_real import CONCURRENCY, FRONTS, ROUNDS  # noqa: E402
from bench.engines import running_engines  # noqa: E402
from bench.procs import run_bench  # noqa: E402
from bench.real_vllm import Load, over_url, samples  # noqa: E402
from extproc.testing import ephemeral_config, running_sidecar  # noqa: E402
from scripts.cached_envs import tiny_model  # noqa: E402
from vllmsim.profiles import PROFILES  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODES = ("pull", "serial_push", "push")
# vllm-project/router PR #187 (4P/4D GPUs, 8B-class model, input 1024 / output 64), median
# TTFT in ms, as quoted in this project's issue; a missing entry is a row we do not have.
PR187: dict[int, dict[str, float]] = {
    8: {"serial_push": 184.0, "push": 123.0},
    32: {"serial_push": 226.0, "push": 182.0},
}
GPU_CONCURRENCY = (1, 8, 32)
TOLERANCE = 0.15


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


def order(row: dict[str, float]) -> str:
    return " < ".join(sorted(row, key=row.__getitem__))


def run_gpu_plan(out: Path, runs: int) -> None:
    """bench/run.py on 4P4D with the gpu-8b profile (writes out/ttft.json)."""
    argv = [
        sys.executable,
        str(ROOT / "bench" / "run.py"),
        "--profile",
        "gpu-8b",
        "--topologies",
        "4P4D",
        "--configs",
        "pull,serial-push,push",
        "--concurrency",
        ",".join(map(str, GPU_CONCURRENCY)),
        "--runs",
        str(runs),
        "--min-requests",
        "24",
        "--out",
        str(out),
    ]
    subprocess.run(argv, check=True, timeout=3600)


def gpu_medians(out: Path) -> dict[str, dict[int, float]]:
    """Median TTFT per mode and C, every run's requests pooled."""
    records = json.loads((out / "ttft.json").read_text())["runs"]
    pooled: dict[str, dict[int, list[float]]] = {}
    for rec in records:
        mode = rec["config"].replace("-", "_")
        pooled.setdefault(mode, {}).setdefault(rec["concurrency"], []).extend(rec["ttfts_ms"])
    return {mode: {c: statistics.median(v) for c, v in row.items()} for mode, row in pooled.items()}


def gpu_table(sim: dict[str, dict[int, float]]) -> tuple[list[str], list[str]]:
    lines = [
        "| C | sim pull | sim serial push | sim push | sim order | PR #187 serial push | "
        "PR #187 push | PR #187 order | push / serial push: sim vs PR #187 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    misses = []
    for c in GPU_CONCURRENCY:
        row = {m: sim[m][c] for m in MODES}
        ref = PR187.get(c, {})
        check = "no PR #187 row"
        if ref:
            sim_ratio = row["push"] / row["serial_push"]
            ref_ratio = ref["push"] / ref["serial_push"]
            ok = abs(sim_ratio / ref_ratio - 1) <= TOLERANCE
            same_order = (row["push"] < row["serial_push"]) == (ref["push"] < ref["serial_push"])
            check = f"{sim_ratio:.2f} vs {ref_ratio:.2f} ({sim_ratio / ref_ratio - 1:+.0%})"
            if not ok:
                misses.append(f"C = {c}: push / serial push {check}, beyond ±15 %")
            if not same_order:
                misses.append(f"C = {c}: push and serial push in the other order")
        lines.append(
            f"| {c} | {row['pull']:.1f} | {row['serial_push']:.1f} | {row['push']:.1f} | "
            f"{order(row)} | {ref.get('serial_push', '–')} | {ref.get('push', '–')} | "
            f"{order(ref) if ref else '–'} | {check} |"
        )
    return lines, misses


def plot(
    real: dict[str, dict[int, float]],
    sim: dict[str, dict[int, float]],
    gpu: dict[str, dict[int, float]] | None,
    path: Path,
) -> None:
    fig, axes = plt.subplots(1, 2 if gpu else 1, figsize=(12 if gpu else 6, 4.5), squeeze=False)
    left = axes[0][0]
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
    if gpu:
        right = axes[0][1]
        for index, mode in enumerate(MODES):
            cs = sorted(gpu[mode])
            right.plot(
                cs,
                [gpu[mode][c] for c in cs],
                "s--",
                color=f"C{index}",
                label=f"{mode} vllmsim gpu-8b",
            )
            ref = [(c, PR187[c][mode]) for c in sorted(PR187) if mode in PR187[c]]
            if ref:
                right.plot(
                    *zip(*ref, strict=True),
                    "o",
                    color=f"C{index}",
                    markersize=9,
                    label=f"{mode} PR #187",
                )
        right.set_xscale("log", base=2)
        right.set_title("4P4D, 8B-class GPU profile vs PR #187")
        right.set_xlabel("concurrency")
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", type=Path, default=RESULTS / "calibration_real.json")
    parser.add_argument("--skip-gpu", action="store_true")
    parser.add_argument("--gpu-runs", type=int, default=2)
    parser.add_argument(
        "--gpu-results",
        type=Path,
        help="a directory where bench/run.py already wrote this plan's ttft.json",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.monotonic()
    real_raw = json.loads(args.real.read_text())
    real = medians(real_raw["cells"])
    sim = medians(await simulate_cpu(real_raw))
    lines = [
        "# vllmsim calibration",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `python bench/calibrate.py"
        f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`; load average "
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
    ]
    gpu = None
    if args.gpu_results:
        gpu = gpu_medians(args.gpu_results)
    elif not args.skip_gpu:
        with tempfile.TemporaryDirectory(prefix="calibrate-gpu-") as tmp:
            run_gpu_plan(Path(tmp), args.gpu_runs)
            gpu = gpu_medians(Path(tmp))
    if gpu:
        table, misses = gpu_table(gpu)
        lines += [
            "## GPU: vllmsim `gpu-8b` (4P4D, not refitted) vs PR #187",
            "",
            *table,
            "",
            "Misses: " + ("; ".join(misses) if misses else "none"),
            "",
        ]
    lines.append(f"Took {time.monotonic() - started:.0f} s.")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.md").write_text(text)
    plot(real, sim, gpu, args.out / "calibration.png")


if __name__ == "__main__":
    run_bench(main())
