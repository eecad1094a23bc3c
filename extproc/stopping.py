"""Stopping the tasks a component owns, even a task that loses its cancellation.

On Python 3.11 a cancellation can be lost: `asyncio.wait_for` returns the awaited result when
that result arrived in the same loop turn as the cancel (3.12 fixed it), and a loop that then
carries on never ends, so `cancel()` followed by `await task` waits forever. CI saw it once: a
Kubernetes watch kept listing for two minutes after its stop. Cancelling again while the task
is still running ends it at its next await.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]

log = logging.getLogger("extproc")


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any] | None],
    recancel_after_s: float = 1.0,  # long enough for a cancelled task's own clean-up
    patience_s: float = 10.0,
) -> None:
    """Cancel `tasks` and wait until each has ended, cancelling again every `recancel_after_s`;
    after `patience_s` give up on the rest with one error line."""
    owned = [task for task in tasks if task is not None]
    pending = {task for task in owned if not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    while pending and (left := deadline - loop.time()) > 0:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(recancel_after_s, left))
    for task in pending:
        log.error("task %r did not end within %g s of being cancelled", task.get_name(), patience_s)
    for task in owned:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: its failure was logged by its owner, or is moot now
