"""Search the GPU profile's physical parameters against PR #187's rows (its plan on the lab).

The score is the squared log error of every cell the aim bounds in absolute terms (C <= 32)
plus that of each mode's ratio to pull at every C; a random local search around the current
profile, within ranges the hardware allows (commented below), keeps the best. It prints the
best profile's values and its table; the values are then written, with their reasons, into
vllmsim/profiles.py by hand (the profile is not generated).

    nice python bench/fit.py --trials 150
    nice python bench/fit.py --set api_intake_ms=1.5,stream_per_token_ms=0.2  # start elsewhere
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pr187 import ABSOLUTE_UP_TO, MODES, ROWS, table
from vllmsim.config import CostModel
from vllmsim.profiles import PROFILES

# (low, high) a value may take: what an 8B-class model on one H100 per engine allows.
RANGES: dict[str, tuple[float, float]] = {
    "step_base_ms": (5.0, 20.0),  # decode step: weights read at ~3 TB/s (5 ms) + overheads
    "prefill_per_token_ms": (0.015, 0.07),  # 16 GFLOP/token at 25-100 % of ~990 TFLOPS
    "decode_per_seq_ms": (0.0, 0.3),  # KV reads of one running sequence per step
    "idle_step_ms": (0.3, 3.0),  # an empty step: scheduler pass + connector
    "api_overhead_ms": (0.5, 15.0),  # what of the request path runs beside the API loop: IPC
    # the API server's one event loop: a request's intake (HTTP parse, validation, input
    # processing, hand-off to the engine core: ~0.3-5 ms of Python for a 1024-token prompt) and
    # each output token's detokenization and SSE chunk (~20-1000 us of Python per token)
    "api_intake_ms": (0.3, 5.0),
    "stream_per_token_ms": (0.02, 1.0),
    # a fast tokenizer encodes ~0.1-2 M tokens/s on one thread (vLLM's renderer has one)
    "tokenize_per_token_ms": (0.0005, 0.01),
    "kv_message_latency_ms": (0.02, 1.0),  # one NIXL notif or side-channel message
    "kv_bandwidth_gbps": (10.0, 50.0),  # one 100-400 Gb/s NIC
}


def score(rows: dict[int, dict[str, float]]) -> float:
    total = 0.0
    for c, row in rows.items():
        ref = ROWS[c]
        if c <= ABSOLUTE_UP_TO:
            total += sum(math.log(row[m] / ref[m]) ** 2 for m in MODES)
        for m in ("serial_push", "push"):
            total += math.log((row[m] / row["pull"]) / (ref[m] / ref["pull"])) ** 2
    return total


def neighbour(cost: CostModel, rng: random.Random, scale: float) -> CostModel:
    name = rng.choice(list(RANGES))
    low, high = RANGES[name]
    value = getattr(cost, name) * math.exp(rng.gauss(0.0, scale))
    return dataclasses.replace(cost, **{name: min(high, max(low, value))})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="gpu-8b", choices=sorted(PROFILES))
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="fixed for the search (default: the profile's)"
    )
    parser.add_argument(
        "--set",
        default="",
        help="start values, name=value,...: the search moves a value by a factor, so one the "
        "profile has at 0 needs a start here",
    )
    args = parser.parse_args()
    cs = tuple(int(c) for c in args.concurrency.split(","))
    rng = random.Random(args.seed)
    best = PROFILES[args.profile]
    if args.max_num_batched_tokens:
        best = dataclasses.replace(best, max_num_batched_tokens=args.max_num_batched_tokens)
    for item in filter(None, args.set.split(",")):
        name, _, value = item.partition("=")
        if name not in RANGES:
            parser.error(f"--set {item}: {name!r} is not one of {', '.join(RANGES)}")
        try:
            best = dataclasses.replace(best, **{name: float(value)})
        except ValueError:
            parser.error(f"--set {item}: {value!r} is not a number")
    best_rows = table(best, cs, runs=1)
    best_score = score(best_rows)
    print(f"start {best_score:.4f}", flush=True)
    for trial in range(args.trials):
        candidate = neighbour(best, rng, 0.3 * (1 - trial / max(1, args.trials)) + 0.05)
        rows = table(candidate, cs, runs=1)
        if (s := score(rows)) < best_score:
            best, best_rows, best_score = candidate, rows, s
            print(f"trial {trial}: {s:.4f}", flush=True)
    print({f: getattr(best, f) for f in RANGES})
    for c, row in best_rows.items():
        ref = ROWS[c]
        print(
            c,
            " ".join(f"{m} {row[m]:.0f} ({ref[m]:.0f})" for m in MODES),
            " ratios",
            " ".join(
                f"{m} {row[m] / row['pull']:.2f} ({ref[m] / ref['pull']:.2f})" for m in MODES[1:]
            ),
        )


if __name__ == "__main__":
    main()
