"""The sidecar's tokenizer on the lab's clock: the product's `OffLoopTokenizer` (its inline
path, its queue bound, its time budget, its lane for long prompts) over workers whose jobs take
simulated time instead of running in processes.

With `--tokenize` the lab's prompts reach the sidecar as text, one word per token id (`t42` is
id 42; `placeholder_tokenizer`'s vocabulary), so that each request goes through
`request_tokens` as a deployment's text prompt does; the engines read the same words back as
the same ids (`lab.workloads.prompt_ids`), as vLLM's own tokenizer would give the sidecar's.
A worker's job costs a hand-off and a time per token (`TokenizerCosts`); a request that finds
the queue full or runs out of time is routed without the KV index, as in the product.

What is not modelled: the CPU the workers take from the engines and the sidecar (each worker is
a core of its own here), a worker's restart after a job past its time (it is free at once).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.kvcache.routing import TokenizerFactory
from extproc.kvcache.tokenize_pool import MAX_PENDING, WORKERS, OffLoopTokenizer
from extproc.kvcache.tokenize_workers import IDS_TYPECODE
from lab.workloads import prompt_ids

__all__ = ["SimulatedWorkers", "TokenizerCosts", "simulated_tokenizers"]


@dataclass(frozen=True)
class TokenizerCosts:
    """What tokenizing costs in simulated time, and the product's bounds on it (by default the
    product's own). A fast byte-level BPE encodes about a token a microsecond on one core
    (0.7 us measured with a small one, 0.25 ms for 16 KB); the hand-off to a worker and back
    costs a request about 0.4 ms whatever its size."""

    us_per_token: float = 1.0
    handoff_ms: float = 0.4
    workers: int = WORKERS
    max_pending: int = MAX_PENDING


class SimulatedWorkers:
    """`TokenizerWorkers` whose jobs hold one of `costs.workers` slots for their simulated
    cost. The lab's prompts are completions' text (`prompt_text`)."""

    def __init__(self, costs: TokenizerCosts) -> None:
        self.workers = costs.workers
        self.load_error: str | None = None
        self._costs = costs
        self._free = asyncio.Semaphore(costs.workers)

    def warm(self) -> None:
        """Nothing to start."""

    async def run(self, chat: bool, job: bytes | str, context: int | None) -> bytes | None:
        text = job if isinstance(job, str) else _prompt(orjson.loads(job))
        ids = prompt_ids(text)
        cost_s = (self._costs.handoff_ms + len(ids) * self._costs.us_per_token / 1e3) / 1e3
        async with self._free:
            await asyncio.sleep(cost_s)
        if context is not None and len(ids) > context:
            return None
        return array(IDS_TYPECODE, ids).tobytes()

    def close(self) -> None:
        """Nothing runs."""


def _prompt(doc: Any) -> str:
    prompt = doc.get("prompt") if isinstance(doc, dict) else None
    if not isinstance(prompt, str):
        raise ValueError("the lab tokenizes completions' text prompts only")
    return prompt


def simulated_tokenizers(costs: TokenizerCosts) -> TokenizerFactory:
    """`KvRouting`'s tokenizers for the lab: the product's, over `SimulatedWorkers`."""

    def make(path: str, on_unknown: Callable[[str], None]) -> OffLoopTokenizer:
        return OffLoopTokenizer(  # its worker count is the pool's
            path,
            max_pending=costs.max_pending,
            on_unknown=on_unknown,
            pool=SimulatedWorkers(costs),
        )

    return make
