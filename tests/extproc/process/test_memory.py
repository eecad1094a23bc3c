"""glibc keeps large buffers warm in its heap until they are given back on purpose."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Run apart: the setting is the whole process's. Buffers of 8 MiB, which glibc's defaults
# would map apart and unmap on free, are freed: the heap keeps them until the trim.
_SCRIPT = """
from pathlib import Path
from extproc.process.memory import give_back_free_memory, keep_large_buffers_warm

def rss_mib():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(l for l in status if l.startswith("VmRSS")).split()[1]) // 1024

assert keep_large_buffers_warm()
base = rss_mib()
buffers = [b"x" * (8 << 20) for _ in range(12)]
del buffers
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
    assert kept >= 80, done.stdout  # of 96 MiB freed: warm for the next bodies
    assert after_trim <= 16, done.stdout
