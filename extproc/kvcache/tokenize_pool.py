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
read them) say so once and are not used.
`close` ends the workers, and a worker whose sidecar died exits on its own.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import select
import signal
import threading
from array import array
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import orjson

from extproc.kvcache.tokens import RequestTokenizer

__all__ = ["TOKENIZED_MEMBERS", "OffLoopTokenizer", "members_object", "token_ids"]

log = logging.getLogger("extproc")

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
_PARENT_CHECK_S = 1.0  # how often a worker without pidfd looks for its sidecar
# Workers are forked by a small server process that has imported the tokenizer's modules,
# rather than by the sidecar: a fork of the sidecar would copy its threads' state (gRPC's,
# ZeroMQ's), and forking or spawning from its large process would hold the event loop while a
# worker is replaced after a job past its time.
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["extproc.kvcache.tokens"])
_NICE = 10  # a worker's CPU share against the sidecar's: about a tenth when both want a core
_IDS = "i"  # int32: vocabulary ids are far below 2**31


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


def token_ids(
    tokenizer: RequestTokenizer, chat: bool, doc: Mapping[str, Any], context: int | None
) -> list[int] | None:
    """The request's ids as vLLM computes them; None where they are more than `context` (the
    longest prompt any engine runs; None: unknown), which is then not worth tokenizing: the
    engines refuse it, so what they hold of it cannot matter. Each character of a text lands
    in one token, whose own text is at most the vocabulary's longest: a text longer than
    `context` times that is more tokens than `context` and is not even encoded. (A tokenizer
    that drops characters, whitespace for one, could fit it: it is then only routed without
    the cache, which is always correct.) Raises ChatTemplateError, TypeError or ValueError
    where the ids cannot be had."""
    if chat:
        kwargs = doc.get("chat_template_kwargs")
        tools = doc.get("tools")
        text = tokenizer.render_chat(
            doc.get("messages") or [],
            add_generation_prompt=doc.get("add_generation_prompt", True) is not False,
            continue_final_message=doc.get("continue_final_message") is True,
            tools=tools if isinstance(tools, list) else None,
            template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        )
    else:
        prompt = doc.get("prompt")
        if not isinstance(prompt, str):
            raise TypeError("only a string prompt is tokenized")
        text = prompt
    if context is not None and len(text) > context * tokenizer.longest_token:
        return None
    ids = tokenizer.encode(text, add_special_tokens=not chat)
    return None if context is not None and len(ids) > context else ids


# -- in a worker process -----------------------------------------------------------------------

_worker_tokenizer: RequestTokenizer | None = None
_worker_error: str | None = None  # why the tokenizer could not be loaded here


def _start_worker(path: str, chat_template: str | None, sidecar: int) -> None:
    """A worker's initializer: load the tokenizer once; yield the CPU to the sidecar's own
    work (ids are a routing hint: on a busy machine a request goes without them, rather than
    the loop waiting for a core); leave Ctrl-C to the sidecar, which closes the pool; exit if
    the sidecar dies without closing it (a killed sidecar)."""
    global _worker_tokenizer, _worker_error
    os.nice(_NICE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _worker_tokenizer = RequestTokenizer.from_path(path, chat_template)
    except Exception as error:  # its files changed since the sidecar read them: said once, by
        _worker_error = f"{type(error).__name__}: {error}"  # `_ready`, not a dying worker each job
    threading.Thread(target=_exit_with, args=(sidecar,), daemon=True).start()


def _exit_with(sidecar: int) -> None:
    """Wait for the sidecar's end, then exit. (Not the parent's: that is the fork server,
    which lives as long as a worker does.)"""
    try:
        handle = os.pidfd_open(sidecar)  # readable once it has exited; immune to pid reuse
    except OSError:  # no pidfd (an old kernel): ask every second
        while _alive(sidecar):
            threading.Event().wait(_PARENT_CHECK_S)
    else:
        select.select([handle], [], [])
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True  # or PermissionError: it exists


def _ready() -> str | None:
    """For a worker to start (and load its tokenizer) before a request needs it: why it could
    not load it, if so."""
    return _worker_error


def _work(chat: bool, job: bytes | str, context: int | None) -> bytes | None:
    if _worker_tokenizer is None:  # not loaded (`_ready` said why)
        return None
    try:
        doc = {"prompt": job} if isinstance(job, str) else orjson.loads(job)
        ids = token_ids(_worker_tokenizer, chat, doc, context)
    except Exception:  # a template can fail any way on a client's values: no ids, as inline
        return None
    return None if ids is None else array(_IDS, ids).tobytes()


# -- in the sidecar ----------------------------------------------------------------------------


class OffLoopTokenizer:
    """A model's tokenizer for the event loop: small requests inline, the rest in `workers`
    worker processes, each loading the tokenizer from `path` once."""

    def __init__(
        self,
        path: str,
        *,
        chat_template: str | None = None,
        workers: int = 2,
        max_pending: int = 256,
        inline_below_bytes: int = 512,
        timeout_s: float = 1.0,
        long_from_bytes: int = 256 << 10,
        on_unknown: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.tokenizer = RequestTokenizer.from_path(path, chat_template)  # raises for bad files
        self.vocab_size = self.tokenizer.vocab_size
        self.longest_token = self.tokenizer.longest_token
        self.chars_per_token = self.tokenizer.chars_per_token
        self._init = (path, chat_template, os.getpid())
        self._workers = workers
        self._max_pending = max_pending
        self._inline_below = inline_below_bytes
        self._timeout_s = timeout_s
        # Long jobs (a 10 MB prompt: a second) leave one worker to the short ones, which
        # would otherwise wait out their whole time budget behind them and route blind.
        self._long_from = long_from_bytes
        # told why a request gets no ids (queue_full, timeout, worker_died, unavailable)
        self._on_unknown = on_unknown
        self._long_lane = asyncio.Semaphore(max(1, workers - 1))
        # One single-process executor per worker, so that one overrunning job can be ended
        # alone (an executor cannot stop one job of several).
        self._all: list[ProcessPoolExecutor] = []
        self._idle: asyncio.Queue[ProcessPoolExecutor] = asyncio.Queue()
        self._pending = 0
        self._closed = False
        self._load_error: str | None = None  # the workers cannot load the tokenizer: why

    def warm(self) -> None:
        """Start the workers now, so that the first long request finds them loaded."""
        while len(self._all) < self._workers and not self._closed:
            self._idle.put_nowait(self._new_worker())

    async def ids(
        self, chat: bool, doc: Mapping[str, Any], job: bytes | str, context: int | None = None
    ) -> list[int] | None:
        """The request's ids (`job`: a completion's prompt text, or `members_object`'s bytes;
        `doc` the request decoded); None where they cannot be had in time, or are more than
        `context` (`token_ids`)."""
        if len(job) < self._inline_below:
            return _inline(self.tokenizer, chat, doc, context)
        if self._load_error is not None or self._pending >= self._max_pending:
            self._on_unknown("unavailable" if self._load_error is not None else "queue_full")
            return None
        self._pending += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                if len(job) < self._long_from:
                    data = await self._in_worker(chat, job, context)
                else:
                    async with self._long_lane:
                        data = await self._in_worker(chat, job, context)
        except TimeoutError:
            self._on_unknown("timeout")
            return None
        finally:
            self._pending -= 1
        if data is None:
            return None
        ids = array(_IDS)
        ids.frombytes(data)
        return ids.tolist()

    async def _in_worker(self, chat: bool, job: bytes | str, context: int | None) -> bytes | None:
        self.warm()
        worker = await self._idle.get()
        ended = True  # a job past its time (or whose request ended) must not run on
        try:
            data = await asyncio.wrap_future(worker.submit(_work, chat, job, context))
            ended = False
        except BrokenProcessPool:
            self._on_unknown("worker_died")
            if not self._closed:
                log.warning("a tokenizer worker died; its request routes without the KV cache")
            return None
        finally:
            if ended:
                self._end(worker)
            if not self._closed:
                self._idle.put_nowait(self._new_worker() if ended else worker)
        return data

    def _new_worker(self) -> ProcessPoolExecutor:
        worker = ProcessPoolExecutor(1, _CONTEXT, initializer=_start_worker, initargs=self._init)
        worker.submit(_ready).add_done_callback(self._loaded)  # start it (and load) now
        self._all.append(worker)
        return worker

    def _loaded(self, ready: Future[str | None]) -> None:
        """A worker started (on an executor's thread: it sets a flag and logs, no more)."""
        if ready.cancelled() or ready.exception() is not None or ready.result() is None:
            return
        if self._load_error is None:
            self._load_error = ready.result()
            log.error(
                "tokenizer workers cannot load %s (%s): prompts of %d bytes or more route "
                "without the KV cache until the sidecar restarts",
                self._init[0],
                self._load_error,
                self._inline_below,
            )

    def _end(self, worker: ProcessPoolExecutor) -> None:
        if worker in self._all:
            self._all.remove(worker)
        _end(worker)

    def close(self) -> None:
        self._closed = True
        for worker in list(self._all):
            self._end(worker)


def _inline(
    tokenizer: RequestTokenizer, chat: bool, doc: Mapping[str, Any], context: int | None
) -> list[int] | None:
    try:
        return token_ids(tokenizer, chat, doc, context)
    except Exception as error:  # a template can fail any way on a client's values: no ids
        log.debug("request not tokenized for the KV index: %s", error)
        return None


def _end(pool: ProcessPoolExecutor) -> None:
    """Stop the pool's workers now: one may be deep in a long job nobody waits for."""
    processes = list((pool._processes or {}).values())  # no public way before 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
