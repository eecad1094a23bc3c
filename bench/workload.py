"""A seeded heavy-tailed workload for `vllm bench serve --dataset-name custom` (no download).

Real traffic is not 1024 tokens in / 64 out: most prompts are short, a few are very long, and
output lengths spread the same way. Both lengths are drawn from lognormal distributions (the
usual fit for chat traffic: a median with a long right tail), clipped to what the engines take:

  prompt tokens  lognormal, median 256, sigma 1.2, in [16, 4096]  (p90 ~1200, mean ~520)
  output tokens  lognormal, median 48, sigma 1.0, in [8, 512]     (p90 ~170, mean ~80)

Each prompt is random token ids of the client's tokenizer, decoded, re-encoded and cut to the
drawn length, as `vllm bench serve`'s own random dataset builds its prompts (so both workloads
have the same bytes per token). The file is JSONL: {"prompt", "output_tokens"} per line;
the client shuffles it with each run's seed.

    python bench/workload.py OUT.jsonl [--count 4096] [--seed 14]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

INPUT_MEDIAN, INPUT_SIGMA, INPUT_RANGE = 256, 1.2, (16, 4096)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 48, 1.0, (8, 512)
SEED, COUNT = 14, 4096


def _draw(rng: random.Random, median: int, sigma: float, bounds: tuple[int, int]) -> int:
    value = round(rng.lognormvariate(math.log(median), sigma))
    return max(bounds[0], min(bounds[1], value))


def heavy_tailed(tokenizer_dir: Path, count: int = COUNT, seed: int = SEED) -> list[dict]:
    from tokenizers import Tokenizer  # the simulator's dependency; lazy like its own import

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab, rng = tokenizer.get_vocab_size(), random.Random(seed)
    rows = []
    for _ in range(count):
        prompt_len = _draw(rng, INPUT_MEDIAN, INPUT_SIGMA, INPUT_RANGE)
        output_len = _draw(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE)
        text = tokenizer.decode([rng.randrange(vocab) for _ in range(prompt_len)])
        ids = tokenizer.encode(text, add_special_tokens=False).ids[:prompt_len]
        rows.append({"prompt": tokenizer.decode(ids), "output_tokens": output_len,
                     "prompt_tokens": len(ids)})  # fmt: skip
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def summary(rows: list[dict]) -> str:
    """One line describing the drawn lengths (for the results file)."""

    def describe(values: list[int]) -> str:
        ordered = sorted(values)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return (f"median {statistics.median(ordered):.0f}, mean {statistics.fmean(ordered):.0f}, "
                f"p90 {pick(0.9)}, p99 {pick(0.99)}, max {ordered[-1]}")  # fmt: skip

    prompt_bytes = sum(len(json.dumps(r["prompt"])) for r in rows)
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    return (f"{len(rows)} requests; prompt tokens {describe([r['prompt_tokens'] for r in rows])}; "
            f"output tokens {describe([r['output_tokens'] for r in rows])}; "
            f"{prompt_bytes / prompt_tokens:.2f} JSON bytes per prompt token")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=COUNT)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.cached_envs import tiny_model

    rows = heavy_tailed(tiny_model(), args.count, args.seed)
    write(args.out, rows)
    print(summary(rows))


if __name__ == "__main__":
    main()
