"""Large buffers go back to the operating system when freed (glibc's malloc).

A request body is held in buffers of megabytes while its upload comes in; glibc serves
allocations above a threshold with their own mappings, returned to the system on free, but it
raises that threshold to the largest buffer freed so far (up to 32 MiB), after which bodies
come from its heap, which it keeps: 40 uploads of 15 MB held at once left the process 800 MiB
larger after they ended. A fixed threshold of 1 MiB keeps every large buffer in its own
mapping (a system call and fresh pages per buffer, small beside the copies of a megabyte
body). Elsewhere (musl, macOS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["return_large_buffers"]

log = logging.getLogger("extproc")

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_THRESHOLD = 1 << 20


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold at 1 MiB; False where there is no glibc to tell."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt differs
        return False
    done = bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD))
    if not done:
        log.debug("mallopt(M_MMAP_THRESHOLD) refused; large buffers stay in the heap")
    return done
