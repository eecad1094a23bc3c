"""glibc keeps large buffers warm in its heap until they are given back on purpose, those of
every thread."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Run apart: the setting is the whole process's. Buffers of 8 MiB, which glibc's defaults
# would map apart and unmap on free, are freed: the heap keeps them until the trim. They are
# made on a thread (as gRPC's and the tokenizer's are), whose own heap the trim would not empty.
_SCRIPT = """
import threading
from pathlib import Path
from extproc.process.memory import give_back_free_memory, keep_large_buffers_warm

def rss_mib():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(l for l in status if l.startswith("VmRSS")).split()[1]) // 1024

assert keep_large_buffers_warm()
base = rss_mib()
kept_alive = []

def copies():
    kept_alive.append(bytearray(4096))  # what the thread keeps, below the buffers in its heap
    buffers = [b"x" * (8 << 20) for _ in range(6)]
    del buffers

thread = threading.Thread(target=copies)
thread.start()
thread.join()
kept = rss_mib() - base
assert give_back_free_memory()
print(kept, rss_mib() - base)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_freed_large_buffers_stay_until_given_back() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    kept, after_trim = map(int, done.stdout.split())
    assert kept >= 40, done.stdout  # of 48 MiB freed: warm for the next bodies
    assert after_trim <= 8, done.stdout
