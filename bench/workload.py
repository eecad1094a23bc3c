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

Two more seeded workloads exercise the engines' prefix caches (bench/cache.py), built from
words that are one token each with their leading space, so that every text of n words is n
tokens wherever it is put, and prompts are token-exact by construction (checked as generated):

  shared-prefix  G groups, each with a system prompt of S tokens; each request is its group's
                 system prompt and a question of Q fresh tokens, O output tokens (1 + S + Q
                 prompt tokens with the BOS)
  multi-turn     N conversations of T turns, each with its own system prompt of S tokens; turn
                 k is the chat template's rendering of the system prompt, the k - 1 previous
                 user messages and answers (A tokens each, fixed up front) and a new user
                 message of U tokens, so turn k's token ids begin with turn k - 1's

    python bench/workload.py OUT.jsonl [--count 4096] [--seed 14]
    python bench/workload.py OUT.jsonl --kind shared-prefix|multi-turn [--seed 14]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

# The shapes and the lengths' distributions are the lab's too (one definition): lab/workloads.py
from lab.workloads import (
    INPUT_MEDIAN,
    INPUT_RANGE,
    INPUT_SIGMA,
    OUTPUT_MEDIAN,
    OUTPUT_RANGE,
    OUTPUT_SIGMA,
    SEED_INPUT,
    SEED_OUTPUT,
    MultiTurn,
    SharedPrefix,
    draw_length,
)

SEED, COUNT = 14, 4096
DEFAULT_SHARED_PREFIX, DEFAULT_MULTI_TURN = SharedPrefix(), MultiTurn()


def heavy_tailed(tokenizer_dir: Path, count: int = COUNT, seed: int = SEED) -> list[dict]:
    from tokenizers import Tokenizer  # the simulator's dependency; lazy like its own import

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab, rng = tokenizer.get_vocab_size(), random.Random(seed)
    rows = []
    for _ in range(count):
        prompt_len = draw_length(rng, INPUT_MEDIAN, INPUT_SIGMA, INPUT_RANGE)
        output_len = draw_length(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE)
        text = tokenizer.decode([rng.randrange(vocab) for _ in range(prompt_len)])
        ids = tokenizer.encode(text, add_special_tokens=False).ids[:prompt_len]
        rows.append(
            {
                "prompt": tokenizer.decode(ids),
                "output_tokens": output_len,
                "prompt_tokens": len(ids),
            }
        )
    return rows


class Words:
    """Texts of an exact token count, from the words of the vocabulary that are one token with
    their leading space (" prefill"): a byte-level pre-tokenizer splits before every space, so
    n such words are n tokens alone, after a BOS, after ": " or before a newline."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.ids = sorted(
            i
            for text, i in vocab.items()
            if text.startswith("\u0120") and text[1:].isalpha() and self._one_token(i)
        )
        if len(self.ids) < 8:
            raise ValueError(f"the tokenizer has only {len(self.ids)} one-token words")

    def _one_token(self, token_id: int) -> bool:
        text = self.tokenizer.decode([token_id])
        return bool(self.tokenizer.encode(text, add_special_tokens=False).ids == [token_id])

    def text(self, rng: random.Random, count: int) -> str:
        """`count` tokens of text, starting with a space."""
        return str(self.tokenizer.decode([rng.choice(self.ids) for _ in range(count)]))


def _tokenizer(tokenizer_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def _rngs(seed: int, salt: str) -> tuple[random.Random, random.Random]:
    """(structure, words): the salt changes the words only, so that runs which must not share
    cached blocks (another configuration, another repetition) get the same shape of workload."""
    return random.Random(seed), random.Random(f"{seed}/{salt}")


def random_words(
    tokenizer_dir: Path,
    count: int,
    seed: int = SEED,
    input_tokens: int = SEED_INPUT,
    output_tokens: int = SEED_OUTPUT,
) -> list[dict]:
    """PR #187's random plan, token-exact: `count` prompts of `input_tokens` with the BOS,
    random one-token words, `output_tokens` out. Unlike `vllm bench serve --dataset-name
    random`, whose prompts are runs of consecutive token ids from a random start, no two
    prompts here share a block: on a small vocabulary (the tiny model's few hundred tokens)
    that dataset's prompts repeat whole (about one in eight of 128), and a repeat is a full
    prefix-cache hit."""
    tokenizer = _tokenizer(tokenizer_dir)
    words, rng = Words(tokenizer), random.Random(f"random-words/{seed}")
    rows = []
    for _ in range(count):
        prompt = words.text(rng, input_tokens - 1)  # the engine adds the BOS
        _check(tokenizer, prompt, input_tokens)
        rows.append(
            {"prompt": prompt, "output_tokens": output_tokens, "prompt_tokens": input_tokens}
        )
    return rows


def shared_prefix(
    tokenizer_dir: Path,
    shape: SharedPrefix = DEFAULT_SHARED_PREFIX,
    count: int = 256,
    seed: int = SEED,
    salt: str = "",
) -> list[dict]:
    """Each request: its group's system prompt, then a fresh question (groups drawn uniformly)."""
    tokenizer = _tokenizer(tokenizer_dir)
    words, (shape_rng, word_rng) = Words(tokenizer), _rngs(seed, salt)
    systems = [words.text(word_rng, shape.system_tokens) for _ in range(shape.groups)]
    expected = 1 + shape.system_tokens + shape.question_tokens  # the BOS the engine adds
    rows = []
    for _ in range(count):
        group = shape_rng.randrange(shape.groups)
        prompt = systems[group] + words.text(word_rng, shape.question_tokens)
        _check(tokenizer, prompt, expected)
        rows.append(
            {
                "prompt": prompt,
                "output_tokens": shape.output_tokens,
                "prompt_tokens": expected,
                "group": group,
            }
        )
    return rows


def multi_turn(
    tokenizer_dir: Path, shape: MultiTurn = DEFAULT_MULTI_TURN, seed: int = SEED, salt: str = ""
) -> list[list[dict]]:
    """Conversations, each a list of turns: {"conversation", "turn", "messages", "prompt" (the
    messages rendered with the model's chat template, generation prompt added, as vLLM renders
    a chat request), "prompt_tokens", "output_tokens"}."""
    tokenizer = _tokenizer(tokenizer_dir)
    words, (_, word_rng), template = (
        Words(tokenizer),
        _rngs(seed, salt),
        _chat_template(tokenizer_dir),
    )
    message = lambda n: words.text(word_rng, n)[1:]  # noqa: E731 (the template adds ": ")
    out = []
    for conversation in range(shape.conversations):
        messages = [{"role": "system", "content": message(shape.system_tokens)}]
        turns = []
        for turn in range(shape.turns):
            if turn:
                messages.append({"role": "assistant", "content": message(shape.answer_tokens)})
            messages.append({"role": "user", "content": message(shape.user_tokens)})
            prompt = template.render(messages=messages, add_generation_prompt=True)
            ids = tokenizer.encode(prompt).ids
            turns.append(
                {
                    "conversation": conversation,
                    "turn": turn,
                    "messages": list(messages),
                    "prompt": prompt,
                    "prompt_tokens": len(ids),
                    "output_tokens": shape.answer_tokens,
                }
            )
        out.append(turns)
    return out


def turn_waves(conversations: list[list[dict]]) -> list[list[dict]]:
    """Turn k of every conversation, for k = 0, 1, ...: the order in which they may be sent."""
    return [
        [c[k] for c in conversations if k < len(c)]
        for k in range(max(map(len, conversations), default=0))
    ]


def _chat_template(tokenizer_dir: Path) -> Any:
    """The folder's chat template, in a Jinja environment set up as Hugging Face's."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise SystemExit(
            "the multi-turn workload renders the chat template with jinja2: pip install jinja2"
        ) from None
    source = (tokenizer_dir / "chat_template.jinja").read_text()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source)


def _check(tokenizer: Any, prompt: str, expected: int) -> None:
    got = len(tokenizer.encode(prompt).ids)
    if got != expected:
        raise AssertionError(f"prompt is {got} tokens, not {expected}")


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def summary(rows: list[dict]) -> str:
    """One line describing the drawn lengths (for the results file)."""

    def describe(values: list[int]) -> str:
        ordered = sorted(values)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return (
            f"median {statistics.median(ordered):.0f}, mean {statistics.fmean(ordered):.0f}, "
            f"p90 {pick(0.9)}, p99 {pick(0.99)}, max {ordered[-1]}"
        )

    prompt_bytes = sum(len(json.dumps(r["prompt"])) for r in rows)
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    return (
        f"{len(rows)} requests; prompt tokens {describe([r['prompt_tokens'] for r in rows])}; "
        f"output tokens {describe([r['output_tokens'] for r in rows])}; "
        f"{prompt_bytes / prompt_tokens:.2f} JSON bytes per prompt token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=COUNT)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--kind",
        choices=("heavy-tailed", "shared-prefix", "multi-turn"),
        default="heavy-tailed",
        help="multi-turn: every turn, waves in order",
    )
    args = parser.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.cached_envs import tiny_model

    if args.kind == "heavy-tailed":
        rows = heavy_tailed(tiny_model(), args.count, args.seed)
    elif args.kind == "shared-prefix":
        rows = shared_prefix(tiny_model(), count=args.count, seed=args.seed)
    else:
        rows = [t for wave in turn_waves(multi_turn(tiny_model(), seed=args.seed)) for t in wave]
    write(args.out, rows)
    print(summary(rows))


if __name__ == "__main__":
    main()
