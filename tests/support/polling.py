"""Waiting for a condition without sleeping a fixed time: poll it, with a timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def until(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0
) -> None:
    """Poll `predicate` until it holds; fail after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def until_true(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """`until` for a check that needs no await."""

    async def holds() -> bool:
        return check()

    await until(holds, what, timeout_s)
