"""The lab at scale: wall time, CPU time and peak memory of one lab run on a generated trace.

A Mooncake-format trace (the format `--trace` replays) is generated with a fixed seed: Poisson
arrivals at `--rate` requests per second, lognormal prompt lengths (median 2048 tokens, at most
7680, so that with its output it fits `gpu-8b`'s 8192) in 512-token blocks, the first blocks of
one prompt in three drawn from 64 shared prefixes (system prompts), lognormal outputs (median
128 tokens, at most 512). Each case runs `pd-extproc-lab` in a process of its own, on a config
of round robin and one of the kv_cache policy (KV events on; `kv_cache_dp2`: the same with two
data-parallel ranks behind every server); its CPU time and peak RSS are that process's own
(`wait4`'s resource usage).

    python bench/lab_scale.py                  # 16P16D x 10,000 and 32P32D x 2,000 requests
    python bench/lab_scale.py --cases 4P4D:500 --profile   # cProfile of the lab's run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "lab-scale.md"
BLOCK = 512
SHARED_PREFIXES = 64
_KV = "policy: kv_cache, kv_events: {port: 5557}, "
CONFIGS = {
    "round_robin": (
        "decision: {mode: off}\nprefill: {policy: round_robin, endpoints: [127.0.0.1:8100]}\n"
        "decode: {policy: round_robin, endpoints: [127.0.0.1:8200]}\n"
    ),
    "kv_cache": (
        "decision: {mode: off}\n"
        f"prefill: {{{_KV}endpoints: [127.0.0.1:8100]}}\n"
        f"decode: {{{_KV}endpoints: [127.0.0.1:8200]}}\n"
    ),
    "kv_cache_dp2": (
        "decision: {mode: off}\n"
        f"prefill: {{{_KV}data_parallel_size: 2, endpoints: [127.0.0.1:8100]}}\n"
        f"decode: {{{_KV}data_parallel_size: 2, endpoints: [127.0.0.1:8200]}}\n"
    ),
}
DEFAULT_CONFIGS = ["kv_cache", "round_robin"]


def _lognormal(rng: random.Random, median: float, sigma: float, top: int) -> int:
    return max(1, min(top, round(rng.lognormvariate(math.log(median), sigma))))


def write_trace(path: Path, requests: int, rate: float, seed: int = 1) -> None:
    """`requests` Mooncake rows at `rate` per second (Poisson), shared prefixes in 1 of 3."""
    rng = random.Random(seed)
    next_block = SHARED_PREFIXES * 4  # ids below: the shared prefixes' blocks
    at = 0.0
    with path.open("w") as out:
        for _ in range(requests):
            length = _lognormal(rng, 2048, 0.8, 7680)
            blocks = math.ceil(length / BLOCK)
            ids = []
            if rng.random() < 1 / 3:  # a shared system prompt of 1-4 blocks
                prefix = rng.randrange(SHARED_PREFIXES)
                ids = [prefix * 4 + k for k in range(min(blocks, 1 + prefix % 4))]
            ids += range(next_block, next_block + blocks - len(ids))
            next_block += blocks
            row = {
                "timestamp": round(at * 1e3, 3),
                "input_length": length,
                "output_length": _lognormal(rng, 128, 0.7, 512),
                "hash_ids": ids,
            }
            out.write(json.dumps(row) + "\n")
            at += rng.expovariate(rate)


def run_case(topology: str, requests: int, rate: float, config: str, profile: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="lab-scale-") as folder:
        tmp = Path(folder)
        trace = tmp / "trace.jsonl"
        write_trace(trace, requests, rate)
        path = tmp / f"{config}.yaml"
        path.write_text(CONFIGS[config])
        lab = ["-m", "lab", "--topology", topology, "--config", str(path), "--trace", str(trace)]
        lab += ["--out", str(tmp / "out")]
        if profile:
            lab = ["-m", "cProfile", "-o", str(ROOT / f"lab-scale-{topology}.prof"), *lab]
        errors = tmp / "stderr.txt"
        started = time.monotonic()
        with errors.open("w") as err:
            child = subprocess.Popen(
                [sys.executable, *lab], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err
            )
            _, status, usage = os.wait4(child.pid, 0)  # this child's own figures
            child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
        if child.returncode:
            sys.exit(f"{topology} {config}: the lab failed:\n{errors.read_text()[-2000:]}")
        summary = json.loads((tmp / "out" / "summary.json").read_text())["configs"][0]
    cpu = usage.ru_utime + usage.ru_stime
    return {
        "topology": topology,
        "config": config,
        "requests": requests,
        "rate": rate,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
        "simulated_s": summary["simulated_s"],
        "ok": summary["ok"],
        "failed": summary["failed"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "cpu_ms_per_request": round(1e3 * cpu / requests, 2),
    }


def _table(rows: list[dict]) -> list[str]:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["16P16D:10000:30", "32P32D:2000:60"],
        help="TOPOLOGY:REQUESTS[:RATE] (rate in requests/s of simulated time, default 30)",
    )
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=sorted(CONFIGS))
    parser.add_argument("--profile", action="store_true", help="cProfile each case's run")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    parser.add_argument(
        "--append", action="store_true", help=f"with --write: add the rows to {RESULTS.name}"
    )
    args = parser.parse_args()
    rows = []
    for case in args.cases:
        topology, requests, *rate = case.split(":")
        for config in args.configs:
            row = run_case(
                topology, int(requests), float(rate[0]) if rate else 30.0, config, args.profile
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = _table(rows)
    print("\n".join(lines))
    if args.write and args.append:
        with RESULTS.open("a") as out:
            out.write("\n".join(lines[2:]) + "\n")
        print(f"appended to {RESULTS}")
    elif args.write:
        load = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
        head = [
            "# The lab at scale",
            "",
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `python bench/lab_scale.py "
            f"--write`; load average at the end {load} (2 cores shared with other work: wall "
            "time is the machine's, CPU time the run's own). One process per row; peak RSS is "
            "the lab process's maximum resident set.",
            "",
        ]
        RESULTS.write_text("\n".join(head + lines) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
