#!/usr/bin/env python3
"""The process benchmark's cells on the lab, with what the decode engines ran (issue 37).

bench/cache.py's shapes at 2P2D (its tight shared-prefix: G = 16 system prompts of 2048 tokens,
a question of 64, 4 x C requests, every P's KV cache 1280 blocks; random: 2 x C prompts of 1024
random tokens, 64 out; random-bench: the prompts `vllm bench serve --dataset-name random` makes
with the processes' tokenizer, see `bench_random`) on the lab (virtual time), for
lab_matrix.py's configurations. Per run:
TTFT p50 / p99, TPOT p50 / p99, each D's running batch sampled every 10 ms of simulated time
(mean and max), the decode-only share, the prompt tokens D computed, and D's steps that
prefilled while it was decoding (a stall): how many, the largest, and how many over 256 tokens
(10 ms at gpu-8b's 0.039 ms per token, the decision's max_stall_ms).

    python bench/lab_batches.py                      # C = 64, seeds 1 and 2
    python bench/lab_batches.py --concurrency 16 --workloads shared-prefix --seeds 1

Each run is niced (it reports simulated times only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllmsim.engine
from bench.lab_matrix import CONFIGS, config_text
from lab.engines import parse_topology
from lab.run import Session, Settings, percentile, run_virtual_session, summarise
from lab.workloads import (
    BOS,
    GENERATORS,
    SEED_INPUT,
    SEED_OUTPUT,
    Chain,
    LabRequest,
    SharedPrefix,
    Workload,
)
from vllmsim.profiles import DEFAULT_PROFILE, PROFILES

WORKLOADS = ("shared-prefix", "random", "random-bench")
BENCH_VOCAB = 479  # the tiny tokenizer's (scripts/cached_envs.tiny_model)
TIGHT = SharedPrefix(groups=16, system_tokens=2048, question_tokens=64, output_tokens=64)
SAMPLE_S = 0.01  # simulated
STALL_TOKENS = 256


def workload(kind: str, seed: int, concurrency: int) -> Workload:
    rng = random.Random(f"lab-workload/{kind}/{seed}")
    if kind == "shared-prefix":
        chains = GENERATORS["shared-prefix"](rng, max(64, 4 * concurrency), TIGHT)  # type: ignore[call-arg]
    elif kind == "random-bench":
        chains = bench_random(rng, 2 * concurrency)
    else:
        chains = GENERATORS["seed"](rng, 2 * concurrency)
    return Workload(f"{kind} C={concurrency}", chains, open_loop=False, concurrency=concurrency)


def bench_random(rng: random.Random, count: int) -> list[Chain]:
    """vLLM's random dataset: prompt i is consecutive token ids from a random offset + i,
    modulo the vocabulary. Over the tiny tokenizer's 479 ids, prompts whose offsets meet are
    the same prompt (~1 in 8 at 128 prompts), which other random prompts never are."""
    chains = []
    for i in range(count):
        offset = rng.randrange(BENCH_VOCAB) + i
        ids = [BOS, *((offset + j) % BENCH_VOCAB + 2 for j in range(SEED_INPUT - 1))]
        chains.append(Chain([LabRequest(ids, SEED_OUTPUT)]))
    return chains


@contextmanager
def stalls() -> Iterator[list[tuple[int, int]]]:
    """Every engine step's (prefill tokens, decode sequences), while in the block."""
    seen: list[tuple[int, int]] = []
    original = vllmsim.engine.step_seconds

    def spy(cost: Any, prefill_tokens: int, decode_seqs: int) -> float:
        seen.append((prefill_tokens, decode_seqs))
        return original(cost, prefill_tokens, decode_seqs)

    vllmsim.engine.step_seconds = spy
    try:
        yield seen
    finally:
        vllmsim.engine.step_seconds = original


def run(config: str, kind: str, seed: int, concurrency: int) -> dict[str, Any]:
    settings = Settings(
        parse_topology("2P2D"),
        PROFILES[DEFAULT_PROFILE],
        seed=seed,
        prefill_kv_blocks=1280 if kind == "shared-prefix" else None,  # the tight regime's
    )
    batches: dict[str, list[int]] = {}

    async def body(lab: Session) -> dict[str, Any]:
        async def sample() -> None:
            while True:
                for engine in lab.cluster.decode:
                    running = sum(len(r.engine.running) for r in engine.ranks)
                    batches.setdefault(engine.name, []).append(running)
                await asyncio.sleep(SAMPLE_S)

        lab.reset_totals()
        started = asyncio.get_running_loop().time()
        sampler = asyncio.create_task(sample())
        try:
            outcomes = await lab.drive(workload(kind, seed, concurrency))
        finally:
            sampler.cancel()
        return summarise(config, outcomes, lab.cluster, lab.settings, started)

    with tempfile.TemporaryDirectory(prefix="lab-batches-") as folder, stalls() as steps:
        path = Path(folder) / f"{config}.yaml"
        path.write_text(config_text(config))
        summary = run_virtual_session(path, settings, body)
    # P's steps decode nothing: a step with both is a prefill on a D that is decoding
    stalled = sorted(p for p, d in steps if p > 0 and d > 0)
    return {
        "config": config,
        "workload": kind,
        "seed": seed,
        "ttft_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "decode_only_share": summary["decode_only_share"],
        "d_computed": summary["decode"]["computed_tokens"],
        "running": {
            name: {"mean": round(sum(v) / len(v), 1), "max": max(v)}
            for name, v in sorted(batches.items())
        },
        "stalls": {
            "steps": len(stalled),
            "largest": stalled[-1] if stalled else 0,
            f"over_{STALL_TOKENS}": sum(1 for p in stalled if p > STALL_TOKENS),
            "p50": percentile(stalled, 50) if stalled else 0,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workloads", default="shared-prefix,random")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args()
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    for name, given, known in (
        ("workloads", args.workloads.split(","), WORKLOADS),
        ("configs", args.configs.split(","), tuple(CONFIGS)),
    ):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"unknown {name} {unknown}; choose from {', '.join(known)}")
    os.nice(19)
    for kind in args.workloads.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            for config in args.configs.split(","):
                line = run(config, kind, seed, args.concurrency)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
