#!/usr/bin/env python3
"""The sidecar's tokenizer in the lab: what its queue bound and its speed do to KV routing.

The tight shared-prefix cell of the process benchmark (bench/lab_batches.py's TIGHT: 2P2D, 16
system prompts of 2048 tokens, each P's cache holding 10 of them) at C = 64, `kv_events`,
with the prompts sent as token ids (nothing to tokenize, the lab's default) and as text that
the sidecar tokenizes (`--tokenize`, lab/tokenizer.py) at several queue bounds and speeds,
against round robin. Per row, the mean over the seeds: TTFT p50 / p99 over round robin's,
the share of P's prompt tokens its cache served, and the requests routed without their ids
(by why). Virtual time: the same command prints the same table.

    python bench/lab_tokenizer.py [--seeds 1,2,3] [--plot bench/results/lab-tokenizer.png]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lab_batches import workload
from bench.lab_matrix import config_text
from lab.engines import parse_topology
from lab.run import Session, Settings, run_virtual_session, summarise
from lab.tokenizer import TokenizerCosts
from vllmsim.profiles import DEFAULT_PROFILE, PROFILES

CONCURRENCY = 64
# (label, config, the tokenizer's costs: None sends token ids)
ROWS: list[tuple[str, str, TokenizerCosts | None]] = [
    ("round robin", "round_robin", None),
    ("kv_events, token ids", "kv_events", None),
    ("kv_events, tokenized, queue 16", "kv_events", TokenizerCosts(max_pending=16)),
    ("kv_events, tokenized, queue 256", "kv_events", TokenizerCosts()),
    ("kv_events, tokenized, 1 worker", "kv_events", TokenizerCosts(workers=1)),
    ("kv_events, tokenized, 20 us a token", "kv_events", TokenizerCosts(us_per_token=20)),
]


def run(config: str, tokenizer: TokenizerCosts | None, seed: int) -> dict[str, Any]:
    settings = Settings(
        parse_topology("2P2D"),
        PROFILES[DEFAULT_PROFILE],
        seed=seed,
        prefill_kv_blocks=1280,
        tokenizer=tokenizer,
    )

    async def body(lab: Session) -> dict[str, Any]:
        lab.reset_totals()
        started = asyncio.get_running_loop().time()
        outcomes = await lab.drive(workload("shared-prefix", seed, CONCURRENCY))
        summary = summarise(config, outcomes, lab.cluster, lab.settings, started)
        summary["kv_untokenized"] = lab.untokenized()
        return summary

    with tempfile.TemporaryDirectory(prefix="lab-tokenizer-") as folder:
        path = Path(folder) / f"{config}.yaml"
        path.write_text(config_text(config))
        return run_virtual_session(path, settings, body)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def ratio(runs: list[dict[str, Any]], base: list[dict[str, Any]], q: str) -> float:
    """The mean over the seeds of TTFT quantile `q` over round robin's in the same seed."""
    return mean([r["ttft_ms"][q] / b["ttft_ms"][q] for r, b in zip(runs, base, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--plot", type=Path, default=None, help="a bar chart of TTFT p50")
    args = parser.parse_args()
    os.nice(10)  # simulated times only: leave the machine to others
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {label: [run(c, t, s) for s in seeds] for label, c, t in ROWS}
    base = results["round robin"]
    print(f"2P2D tight shared-prefix, C = {CONCURRENCY}, seeds {args.seeds}, means over seeds")
    print("| row | TTFT p50 / p99 ÷ rr | P cached % | untokenized (by why, per run) |")
    print("|---|---|---|---|")
    p50s = {}
    for label, runs in results.items():
        p50, p99 = ratio(runs, base, "p50"), ratio(runs, base, "p99")
        cached = mean([100 * r["prefill"]["cached_share"] for r in runs])
        missed: dict[str, float] = {}
        for r in runs:
            for reason, n in r["kv_untokenized"].items():
                missed[reason] = missed.get(reason, 0) + n / len(runs)
        why = ", ".join(f"{k} {v:.0f}" for k, v in sorted(missed.items())) or "none"
        print(f"| {label} | {p50:.2f} / {p99:.2f} | {cached:.0f} | {why} |")
        p50s[label] = p50
    if args.plot is not None:
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(8, 3.5))
        axes.barh(list(p50s)[::-1], list(p50s.values())[::-1])
        axes.set_xlabel("TTFT p50 ÷ round robin's (lower is better)")
        axes.set_title(f"2P2D tight shared-prefix, C = {CONCURRENCY} (lab, seeds {args.seeds})")
        figure.tight_layout()
        figure.savefig(args.plot)
        print(args.plot)


if __name__ == "__main__":
    main()
