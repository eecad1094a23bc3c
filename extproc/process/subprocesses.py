"""Stopping a child process we started in its own session: ask, wait (bounded), then kill.

Envoy, the extra ext_proc workers and the processes tests and benchmarks start all stop this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

__all__ = ["terminate"]


async def terminate(
    process: asyncio.subprocess.Process, grace_s: float, whole_group: bool = False
) -> None:
    """SIGTERM (to its whole group with `whole_group`), then SIGKILL the group after grace_s."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        if whole_group:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
