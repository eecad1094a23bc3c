"""The worker processes that compute request token ids off the sidecar's event loop.

Each worker is a single-process executor of its own, so that one job past its time can be ended
alone (an executor cannot stop one job of several) and replaced. Workers are forked by a small
server process that has imported the tokenizer's modules, rather than by the sidecar: a fork of
the sidecar would copy its threads' state (gRPC's, ZeroMQ's), and forking or spawning from its
large process would hold the event loop while a worker is replaced. A worker loads the
tokenizer once, runs at a lower CPU priority than the sidecar, and exits on its own if the
sidecar dies without closing it. `OffLoopTokenizer` bounds and times what it is given.
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
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Protocol

import orjson

from extproc.kvcache.tokens import RequestTokenizer, token_ids

__all__ = ["IDS_TYPECODE", "TokenizerWorkers", "WorkerProcesses"]

log = logging.getLogger("extproc")

IDS_TYPECODE = "i"  # ids come back as an int32 array's bytes: vocabulary ids are far below 2**31
_PARENT_CHECK_S = 1.0  # how often a worker without pidfd looks for its sidecar
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["extproc.kvcache.tokenize_workers"])
_NICE = 10  # a worker's CPU share against the sidecar's: about a tenth when both want a core


class TokenizerWorkers(Protocol):
    """Where `OffLoopTokenizer` runs a job: `workers` of them at once."""

    workers: int
    load_error: str | None  # the workers cannot load the tokenizer: why (then not used)

    def warm(self) -> None: ...

    async def run(self, chat: bool, job: bytes | str, context: int | None) -> bytes | None:
        """The job's ids as `IDS_TYPECODE` array bytes; None where it has none. Cancelled (its
        time is up), the job stops running."""
        ...

    def close(self) -> None: ...


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
    return None if ids is None else array(IDS_TYPECODE, ids).tobytes()


class WorkerProcesses:
    """`workers` worker processes loading the tokenizer at `path` (and `chat_template`) once.
    `on_unknown("worker_died")`: a worker died under its job."""

    def __init__(
        self,
        path: str,
        chat_template: str | None,
        workers: int,
        on_unknown: Callable[[str], None],
    ) -> None:
        self.workers = workers
        self.load_error: str | None = None
        self._init = (path, chat_template, os.getpid())
        self._on_unknown = on_unknown
        self._all: list[ProcessPoolExecutor] = []
        self._idle: asyncio.Queue[ProcessPoolExecutor] = asyncio.Queue()
        self._closed = False

    def warm(self) -> None:
        """Start the workers now, so that the first long request finds them loaded."""
        while len(self._all) < self.workers and not self._closed:
            self._idle.put_nowait(self._new_worker())

    async def run(self, chat: bool, job: bytes | str, context: int | None) -> bytes | None:
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
        if self.load_error is None:
            self.load_error = ready.result()
            log.error(
                "tokenizer workers cannot load %s (%s): long prompts route without the KV "
                "cache until the sidecar restarts",
                self._init[0],
                self.load_error,
            )

    def _end(self, worker: ProcessPoolExecutor) -> None:
        if worker in self._all:
            self._all.remove(worker)
        _end(worker)

    def close(self) -> None:
        self._closed = True
        for worker in list(self._all):
            self._end(worker)


def _end(pool: ProcessPoolExecutor) -> None:
    """Stop the pool's workers now: one may be deep in a long job nobody waits for."""
    processes = list((pool._processes or {}).values())  # no public way before 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
