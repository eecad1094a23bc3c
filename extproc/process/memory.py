"""Large buffers stay warm while request bodies come and go back to the system once they are
gone (glibc's malloc).

A 10 MB body is copied several times on its way (gathered, decoded, spliced into the legs'
bodies, serialised for gRPC). glibc serves a buffer above its mmap threshold with a mapping of
its own, returned to the system when freed, so that the next one's first touch faults every
page in again: a 10 MB copy then costs 6-24 ms instead of about 1 ms in memory already touched
(bench/results/big-bodies.md). So buffers of up to 32 MiB (glibc's ceiling) come from the heap,
which keeps freed memory for the next ones: the top of the heap is not trimmed on free either,
each trim being a system call and the next body's pages faulted in again, and every thread
shares the one heap, all of which the trim can empty. What the heap keeps is given back by
`give_back_free_memory` (`malloc_trim`), called once big bodies are gone
(`extproc.process.memory_trim`). Elsewhere (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["give_back_free_memory", "keep_large_buffers_warm"]

log = logging.getLogger("extproc")

# glibc's mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_THRESHOLD = 32 << 20  # the most glibc accepts: larger buffers keep their own mappings
_TRIM_THRESHOLD = 2**31 - 1  # the largest C int: never on free, `give_back_free_memory` trims
# One heap for every thread: `malloc_trim` leaves the free top of other threads' heaps in place,
# where gRPC's and the tokenizer's threads left 60-90 MiB of bodies' copies after a burst.
_ARENA_MAX = 1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt differs
        return None
    return libc


def keep_large_buffers_warm() -> bool:
    """Serve buffers of up to 32 MiB from the one heap of all threads and keep freed ones
    there until `give_back_free_memory`; False where there is no glibc to tell (or it
    refused). Threads that allocated before keep their own heaps: call it first thing."""
    libc = _glibc()
    if libc is None:
        return False
    done = all(
        libc.mallopt(parameter, value)
        for parameter, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
            (_M_ARENA_MAX, _ARENA_MAX),
        )
    )
    if not done:
        log.debug("mallopt refused; large buffers keep glibc's defaults")
    return done


def give_back_free_memory() -> bool:
    """Return the heap's free memory to the system (every arena); False without glibc.

    It blocks while it walks the arenas, holding each one's lock: about 30-60 ms for a few
    hundred MiB freed. Call it from a thread, and only once the large buffers are gone."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
