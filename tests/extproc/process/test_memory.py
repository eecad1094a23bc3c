"""glibc's mmap threshold is fixed, so that freed request bodies go back to the system."""

from __future__ import annotations

import platform

import pytest

from extproc.process.memory import return_large_buffers


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_the_threshold_is_set_on_glibc() -> None:
    assert return_large_buffers() is True
