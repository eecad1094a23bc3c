"""Measure real vLLM CPU engines for the simulator's calibration (bench/calibrate.py reads it).

Pull, serial push and parallel push through pd-extproc, c = 1, 2, 4, `--requests` streamed
completions per cell, plus both engines' /metrics before and after each session, from which
calibrate.py derives the engines' step and transfer times. Other work on the machine drifts,
so the push pair and the pull pair take turns (`--sessions` each, alternating), and within a
session the fronts take turns per round. Every front gets its own prompts (vLLM's prefix
cache would otherwise serve the second front from the first one's blocks). Every request's
TTFT is kept, so the comparison can pool or re-summarise without running again.

    python bench/calibrate_real.py [--requests 24] [--out bench/results/calibration_real.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.procs import run_bench  # noqa: E402
from bench.real_vllm import Load, front, learn_identity, samples, warm_up  # noqa: E402
from scripts.cached_envs import VLLM_VERSION  # noqa: E402
from scripts.real_vllm import RealEngine, running_pair  # noqa: E402

CONCURRENCY = (1, 2, 4)
ROUNDS = 2  # rounds per session; a cell pools sessions x ROUNDS x requests/(sessions x ROUNDS)
# front name -> pd-extproc dispatch mode, per engine pair
FRONTS = {"push": [("push", "push"), ("serial_push", "serial_push")], "pull": [("pull", "pull")]}


def histogram_lines(text: str) -> str:
    """The vLLM histograms' _sum and _count lines: what the step-time fit needs."""
    return "\n".join(
        line
        for line in text.splitlines()
        if line.startswith("vllm:")
        and line.split("{")[0].split(" ")[0].endswith(("_sum", "_count"))
    )


async def metrics_text(engine: RealEngine) -> str:
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(engine.url + "/metrics") as response,
    ):
        return histogram_lines(await response.text())


async def prompt_tokens(engine: RealEngine, prompt: str) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as session,
        session.post(engine.url + "/v1/completions", json=body) as response,
    ):
        return int((await response.json())["usage"]["prompt_tokens"])


async def measure_pair(mode: str, load: Load, session: int, sessions: int, out: dict) -> None:
    per_round = max(1, load.requests // (ROUNDS * sessions))
    async with running_pair(mode) as (p, d), contextlib.AsyncExitStack() as stack:  # type: ignore[arg-type]
        identity = await learn_identity(p) if mode == "push" else {}
        await warm_up(p, d, load, identity, mode)
        asks = {
            name: await stack.enter_async_context(front(p, d, dispatch, load, identity))
            for name, dispatch in FRONTS[mode]
        }
        before = {"P": await metrics_text(p), "D": await metrics_text(d)}
        for index, concurrency in enumerate(CONCURRENCY):
            for round_ in range(ROUNDS):
                names = list(asks)[round_ % len(asks) :] + list(asks)[: round_ % len(asks)]
                for name in names:
                    front_no = [n for fronts in FRONTS.values() for n, _ in fronts].index(name)
                    seed = 10_000 * session + 1000 * front_no + 100 * index + round_
                    got = await samples(asks[name], concurrency, per_round, load.prompt_words, seed)
                    cell = out["cells"].setdefault(name, {}).setdefault(str(concurrency), [])
                    cell += [round(t * 1e3, 3) for t in got]
            for name in asks:
                values = sorted(out["cells"][name][str(concurrency)])
                print(
                    f"{name:12} c={concurrency}: median {values[len(values) // 2]:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        after = {"P": await metrics_text(p), "D": await metrics_text(d)}
        out["metrics"].setdefault(mode, []).append({"before": before, "after": after})
        if "prompt_tokens" not in out:
            from bench.real_vllm import prompts

            out["prompt_tokens"] = await prompt_tokens(p, prompts(1, load.prompt_words, 7)[0])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=2, help="pair starts per mode")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "calibration_real.json"
    )
    args = parser.parse_args()
    load = Load(args.requests, args.prompt_words, args.max_tokens)
    started = time.monotonic()
    out: dict = {
        "vllm": VLLM_VERSION,
        "requests": args.requests,
        "prompt_words": args.prompt_words,
        "max_tokens": args.max_tokens,
        "sessions": args.sessions,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cells": {},
        "metrics": {},
    }
    for session in range(args.sessions):  # one pair at a time: each engine is ~3.25 GB
        for mode in ("push", "pull") if session % 2 == 0 else ("pull", "push"):
            await measure_pair(mode, load, session, args.sessions, out)
    out["duration_s"] = round(time.monotonic() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out} in {out['duration_s']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    run_bench(main())
