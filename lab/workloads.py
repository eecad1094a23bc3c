"""What the lab's clients send: a Mooncake-format trace, or the benchmarks' generators.

Every prompt is token ids (a completions request's `prompt` as a list), which the sidecar's
tokenizer and vllmsim's engines both take as they are: equal ids are equal prefixes wherever
they meet the KV caches, and no tokenizer's quirks enter the figures.

A workload is a list of chains: each chain's requests go one after another (the turns of a
conversation), each after the previous one's last token; a chain of one is a lone request.
Open loop: each chain starts at its own time. Closed loop: C clients each take the next chain
when theirs is done.

Mooncake FAST'25 trace (JSONL; the format aiperf and Dynamo replay): one request a line,
`timestamp` (ms from the start), `input_length`, `output_length`, `hash_ids` (one per
512-token block of the prompt; equal ids, equal blocks). A block's token ids are drawn from a
generator seeded by its hash id, so two requests sharing leading hash ids share those prefix
tokens; a prompt longer than its blocks is filled with tokens of its own, a shorter one cut.

The generators, by the shapes bench/workload.py gives the process benchmarks:
  seed           PR #187's plan: 2 x C prompts of 1024 random tokens, 64 out
  shared-prefix  `SharedPrefix`: groups' system prompts, then a fresh question each
  multi-turn     `MultiTurn`: conversations whose turn k begins with turn k - 1's prompt,
                 that turn's answer and a new user message
  mixed          the heavy-tailed mix: lognormal prompt and output lengths
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "GENERATORS",
    "MOONCAKE_BLOCK",
    "Chain",
    "LabRequest",
    "MultiTurn",
    "SharedPrefix",
    "TraceError",
    "Workload",
    "draw_length",
    "generate",
    "prompt_ids",
    "prompt_text",
    "random_prompts",
    "read_mooncake",
]

MOONCAKE_BLOCK = 512  # tokens per hash id
_BLOCKS_KEPT = 4096  # Mooncake blocks' token ids kept made (about 70 MB)
VOCAB = 128_000  # token ids are drawn from [1, VOCAB)
SEED_INPUT, SEED_OUTPUT = 1024, 64  # PR #187's plan (vllm bench serve --dataset-name random)
# The heavy-tailed mix (bench/workload.py's `heavy_tailed`): lognormal lengths, clipped.
INPUT_MEDIAN, INPUT_SIGMA, INPUT_RANGE = 256, 1.2, (16, 4096)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 48, 1.0, (8, 512)


@dataclass(frozen=True)
class SharedPrefix:
    groups: int = 8
    system_tokens: int = 1024
    question_tokens: int = 64
    output_tokens: int = 64


@dataclass(frozen=True)
class MultiTurn:
    conversations: int = 16
    turns: int = 6
    system_tokens: int = 256
    user_tokens: int = 96
    answer_tokens: int = 64  # the fixed previous answers in the history, and each turn's output


@dataclass(frozen=True)
class LabRequest:
    # the prompt's token ids, or how to make them when the request is sent (a trace's: a
    # long trace's prompts, held at once, would take gigabytes)
    tokens: list[int] | Callable[[], list[int]] = field(repr=False)
    output_tokens: int
    session: str | None = None  # the session header's value (a conversation's id)

    @property
    def prompt(self) -> list[int]:
        return self.tokens() if callable(self.tokens) else self.tokens


@dataclass(frozen=True)
class Chain:
    requests: list[LabRequest]
    at: float = 0.0  # open loop: when its first request is sent (s)


@dataclass(frozen=True)
class Workload:
    name: str
    chains: list[Chain]
    open_loop: bool  # each chain at its `at`; else closed loop at `concurrency`
    concurrency: int = 1

    @property
    def requests(self) -> int:
        return sum(len(c.requests) for c in self.chains)


class TraceError(ValueError):
    """A trace line that is not a Mooncake request; the message names the line."""


def draw_length(rng: random.Random, median: int, sigma: float, bounds: tuple[int, int]) -> int:
    """A lognormal length around `median`, clipped to `bounds`."""
    value = round(rng.lognormvariate(math.log(median), sigma))
    return max(bounds[0], min(bounds[1], value))


def random_prompts(seed: int, count: int, length: int = SEED_INPUT) -> list[list[int]]:
    """`vllm bench serve --dataset-name random --random-range-ratio 0`: `count` prompts of
    `length` random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(count)]


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(count)]


@functools.lru_cache(maxsize=_BLOCKS_KEPT)
def _block(hash_id: int) -> list[int]:
    """A Mooncake block's token ids, from its hash id (the recent ones kept: shared prefixes
    are made once, and memory stays bounded on a long trace)."""
    return _tokens(random.Random(f"mooncake-block/{hash_id}"), MOONCAKE_BLOCK)


@dataclass(frozen=True)
class _MooncakePrompt:
    """A trace request's prompt, made when it is sent: its blocks' tokens, cut to its length
    or filled with tokens of its own (drawn from where it is in the trace)."""

    hash_ids: tuple[int, ...]
    length: int
    where: str

    def __call__(self) -> list[int]:
        prompt = [t for h in self.hash_ids for t in _block(h)][: self.length]
        if len(prompt) < self.length:  # past its blocks: tokens of its own
            tail = random.Random(f"mooncake-tail/{self.where}")
            prompt += _tokens(tail, self.length - len(prompt))
        return prompt


def _field(row: dict[str, object], name: str, where: str) -> int:
    value = row.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: '{name}' must be a non-negative number (it is {value!r})")
    return int(value)


def _mooncake_rows(path: Path) -> Iterator[tuple[str, dict[str, object]]]:
    try:
        lines = path.open()
    except OSError as error:
        raise TraceError(f"cannot read the trace {path}: {error.strerror}") from None
    with lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceError(f"{where}: not JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: expected a JSON object per line")
            yield where, row


def read_mooncake(path: Path, speedup: float = 1.0, limit: int | None = None) -> Workload:
    """The trace's requests, open loop at their timestamps divided by `speedup`."""
    if speedup <= 0:
        raise TraceError("--speedup must be positive")
    chains = list[Chain]()
    for where, row in _mooncake_rows(path):
        if limit is not None and len(chains) >= limit:
            break
        at_ms = _field(row, "timestamp", where)
        length = _field(row, "input_length", where)
        output = max(1, _field(row, "output_length", where))
        hash_ids = row.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids):
            raise TraceError(f"{where}: 'hash_ids' must be a list of integers")
        if length < 1:
            raise TraceError(f"{where}: a request needs input_length >= 1")
        prompt = _MooncakePrompt(tuple(hash_ids), length, where)
        chains.append(Chain([LabRequest(prompt, output)], at_ms / 1e3 / speedup))
    if not chains:
        raise TraceError(f"{path}: no requests in the trace")
    chains.sort(key=lambda c: c.at)
    return Workload(f"trace {path.name}", chains, open_loop=True)


# -- the generators --------------------------------------------------------------------------

BOS = 1


def _seed_plan(rng: random.Random, count: int) -> list[Chain]:
    prompts = random_prompts(rng.randrange(2**31), count)
    return [Chain([LabRequest(p, SEED_OUTPUT)]) for p in prompts]


def _shared_prefix(
    rng: random.Random, count: int, shape: SharedPrefix = SharedPrefix()
) -> list[Chain]:
    systems = [_tokens(rng, shape.system_tokens) for _ in range(shape.groups)]
    chains = []
    for _ in range(count):
        system = systems[rng.randrange(shape.groups)]
        prompt = [BOS, *system, *_tokens(rng, shape.question_tokens)]
        chains.append(Chain([LabRequest(prompt, shape.output_tokens)]))
    return chains


def _multi_turn(rng: random.Random, count: int) -> list[Chain]:
    """`count` turns in all: conversations of `shape.turns` turns (the last one shorter)."""
    shape = MultiTurn()
    chains = []
    for conversation in range(math.ceil(count / shape.turns)):
        history = [BOS, *_tokens(rng, shape.system_tokens)]
        turns = []
        for turn in range(min(shape.turns, count - conversation * shape.turns)):
            if turn:
                history += _tokens(rng, shape.answer_tokens)  # the previous turn's answer
            history += _tokens(rng, shape.user_tokens)
            turns.append(LabRequest(list(history), shape.answer_tokens, f"conv-{conversation}"))
        chains.append(Chain(turns))
    return chains


def _mixed(rng: random.Random, count: int) -> list[Chain]:
    chains = []
    for _ in range(count):
        prompt_len = draw_length(rng, INPUT_MEDIAN, INPUT_SIGMA, INPUT_RANGE)
        output_len = draw_length(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE)
        chains.append(Chain([LabRequest(_tokens(rng, prompt_len), output_len)]))
    return chains


GENERATORS = {
    "seed": _seed_plan,
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "mixed": _mixed,
}


def default_count(kind: str, concurrency: int) -> int:
    """Requests a generator makes unless told: the seed plan's 2 x C, else 256 (multi-turn:
    its default shape's 16 conversations x 6 turns)."""
    if kind == "seed":
        return 2 * concurrency
    if kind == "multi-turn":
        shape = MultiTurn()
        return shape.conversations * shape.turns
    return 256


def generate(
    kind: str,
    seed: int,
    concurrency: int | None = None,
    rate: float | None = None,
    count: int | None = None,
) -> Workload:
    """A generator's requests, closed loop at `concurrency` or open loop at `rate` (req/s,
    Poisson arrivals of the chains)."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give --concurrency (closed loop) or --rate (open loop)")
    if concurrency is not None and concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if rate is not None and rate <= 0:
        raise ValueError("--rate must be positive")
    rng = random.Random(f"lab-workload/{kind}/{seed}")
    chains = GENERATORS[kind](rng, count or default_count(kind, concurrency or 1))
    if rate is None:
        name = f"{kind} C={concurrency}"
        return Workload(name, chains, open_loop=False, concurrency=concurrency or 1)
    at, timed = 0.0, []
    for chain in chains:
        timed.append(Chain(chain.requests, at))
        at += rng.expovariate(rate)
    return Workload(f"{kind} at {rate:g} req/s", timed, open_loop=True)


def prompt_text(ids: list[int]) -> str:
    """The prompt the lab sends for `ids` when it tokenizes: a word per id."""
    return " ".join(f"t{i}" for i in ids)


def prompt_ids(text: str) -> list[int]:
    """`prompt_text`'s ids back, as the engines' tokenizer reads them."""
    return [int(word[1:]) for word in text.split()]
