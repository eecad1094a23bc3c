"""Request token ids computed in worker processes, so that no prompt holds the event loop.

`tokenizers`' `encode` keeps the GIL while it works and a chat template renders in Python: on a
thread of this process either stops the event loop for as long as it runs (a 10 MB prompt took
seconds). So what grows with the input runs in a few worker processes, each of which loads the
tokenizer and its template once. The loop hands a worker a completion's prompt text, or a chat's
own JSON members as bytes (nothing decoded on the loop), one copy to pickle either way, and gets
the ids back as the bytes of an int32 array (no per-integer unpickling on the loop). Requests
smaller than `inline_below_bytes` run inline, where the hand-off would cost the loop as much as
the work: measured with an 8,000-token byte-level BPE, the hand-off costs the loop 0.07-0.09 ms
whatever the size (and the request 0.4 ms more), encoding inline 0.07 ms at 256 bytes, 0.10 ms
at 512, 0.20 ms at 1 KB, 4 ms at 16 KB.

Long jobs (`long_from_bytes`) run in all workers but one, so that a burst of them cannot make
the short ones wait out their time budget. Bounded: at most `max_pending` requests wait for or
run in the workers, each for at most `timeout_s`; past either the answer is None and the caller
routes without the KV index, and the worker of a job past its time is ended (and replaced)
rather than left to run on. A request routed without the index may go to an engine that does
not hold its prompt, which then holds it too and evicts another: the queue is sized for a
busy sidecar's concurrent prompts (16 routed a fifth of a 2P2D C = 64 burst so), and what it
holds, one copy of each prompt, is within the bodies' own bound
(`limits.max_body_bytes_in_flight`). A prompt longer than the engines' context length
(`KvRouting.context`) is not worth its ids: None. A worker that dies costs its request (None)
and is replaced; workers that cannot load the tokenizer (its files changed since the sidecar
read them) say so once and are not used. The workers are `tokenize_workers`' processes, or a
`pool` given instead (the lab's, whose jobs take simulated time): the bounds above are this
module's either way.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from extproc.kvcache.tokenize_workers import IDS_TYPECODE, TokenizerWorkers, WorkerProcesses
from extproc.kvcache.tokens import RequestTokenizer, token_ids

__all__ = ["MAX_PENDING", "TOKENIZED_MEMBERS", "WORKERS", "OffLoopTokenizer", "members_object"]

log = logging.getLogger("extproc")

WORKERS = 2  # worker processes: one is left to short prompts while long ones take the rest
MAX_PENDING = 256  # requests waiting for or in a worker (16 routed a fifth of a burst blind)

# The request members the tokenizer reads, per API (True: chat).
TOKENIZED_MEMBERS = {
    True: frozenset(
        {
            "messages",
            "tools",
            "chat_template_kwargs",
            "add_generation_prompt",
            "continue_final_message",
        }
    ),
    False: frozenset({"prompt"}),
}


def members_object(parts: Sequence[tuple[str, bytes | memoryview]], chat: bool) -> bytes:
    """The JSON object of the request's members that the tokenizer reads, from their raw bytes
    (`ClientRequest.parts`: each a complete `"key": value`)."""
    wanted = TOKENIZED_MEMBERS[chat]
    pieces: list[bytes | memoryview] = [b"{"]
    for key, raw in parts:
        if key in wanted:
            pieces += (raw, b",")
    if len(pieces) > 1:
        pieces.pop()  # the last comma
    pieces.append(b"}")
    return b"".join(pieces)  # one copy of a long prompt (each `+` of the whole made another)


class OffLoopTokenizer:
    """A model's tokenizer for the event loop: small requests inline, the rest in `workers`
    worker processes, each loading the tokenizer from `path` once (or in `pool`: where its
    jobs run, given instead)."""

    def __init__(
        self,
        path: str,
        *,
        chat_template: str | None = None,
        workers: int = WORKERS,
        max_pending: int = MAX_PENDING,
        inline_below_bytes: int = 512,
        timeout_s: float = 1.0,
        long_from_bytes: int = 256 << 10,
        on_unknown: Callable[[str], None] = lambda reason: None,
        pool: TokenizerWorkers | None = None,
    ) -> None:
        self.tokenizer = RequestTokenizer.from_path(path, chat_template)  # raises for bad files
        self.vocab_size = self.tokenizer.vocab_size
        self.longest_token = self.tokenizer.longest_token
        self.chars_per_token = self.tokenizer.chars_per_token
        self._max_pending = max_pending
        self._inline_below = inline_below_bytes
        self._timeout_s = timeout_s
        # Long jobs (a 10 MB prompt: a second) leave one worker to the short ones, which
        # would otherwise wait out their whole time budget behind them and route blind.
        self._long_from = long_from_bytes
        # told why a request gets no ids (queue_full, timeout, worker_died, unavailable)
        self._on_unknown = on_unknown
        self._pool = pool or WorkerProcesses(path, chat_template, workers, on_unknown)
        self._long_lane = asyncio.Semaphore(max(1, self._pool.workers - 1))
        self._pending = 0

    def warm(self) -> None:
        """Start the workers now, so that the first long request finds them loaded."""
        self._pool.warm()

    async def ids(
        self, chat: bool, doc: Mapping[str, Any], job: bytes | str, context: int | None = None
    ) -> list[int] | None:
        """The request's ids (`job`: a completion's prompt text, or `members_object`'s bytes;
        `doc` the request decoded); None where they cannot be had in time, or are more than
        `context` (`token_ids`)."""
        if len(job) < self._inline_below:
            return _inline(self.tokenizer, chat, doc, context)
        unavailable = self._pool.load_error is not None
        if unavailable or self._pending >= self._max_pending:
            self._on_unknown("unavailable" if unavailable else "queue_full")
            return None
        self._pending += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                if len(job) < self._long_from:
                    data = await self._pool.run(chat, job, context)
                else:
                    async with self._long_lane:
                        data = await self._pool.run(chat, job, context)
        except TimeoutError:
            self._on_unknown("timeout")
            return None
        finally:
            self._pending -= 1
        if data is None:
            return None
        ids = array(IDS_TYPECODE)
        ids.frombytes(data)
        return ids.tolist()

    def close(self) -> None:
        self._pool.close()


def _inline(
    tokenizer: RequestTokenizer, chat: bool, doc: Mapping[str, Any], context: int | None
) -> list[int] | None:
    try:
        return token_ids(tokenizer, chat, doc, context)
    except Exception as error:  # a template can fail any way on a client's values: no ids
        log.debug("request not tokenized for the KV index: %s", error)
        return None
