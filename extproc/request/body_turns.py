"""Big bodies take turns on the event loop, so that small requests are not queued behind them.

A 10 MB body costs the loop about 100 ms, in a few long steps that each hold the GIL: decoding
it, splicing the legs' bodies, handing D's body to gRPC. Eight of them at once put up to eight
such steps in the loop's ready queue, and each step of a small request beside them waited
behind all of them: its p99 was near a second (bench/results/big-bodies.md). Here a body of at
least `min_bytes` takes a turn for each of those steps: one big body's step at a time, in
arrival order (asyncio's Lock wakes its waiters first in, first out), the turn handed on when
the step is done. A small request's step then waits behind one big step at most, while the
big bodies' own work is no slower: the loop ran their steps one after another anyway. Small
bodies never wait for a turn.

A turn is awaited for at most `wait_s`: past it the step runs without one (as every step did
before turns), so that a step held up in its own I/O (a write to Envoy waiting for room) delays
the others by that bound at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["BodyTurns"]


class BodyTurns:
    """The turns of one process's big bodies (a lock per event loop: one process, one loop)."""

    def __init__(self, min_bytes: int = 1 << 20, wait_s: float = 2.0) -> None:
        self.min_bytes = min_bytes
        self.wait_s = wait_s
        self._lock = asyncio.Lock()

    @asynccontextmanager
    async def turn(self, body_bytes: int) -> AsyncIterator[None]:
        """Run the block as the one big body's step on the loop (a body under `min_bytes`:
        at once)."""
        if body_bytes < self.min_bytes:
            yield
            return
        # What became ready during the body's previous step runs first: an uncontended lock
        # is taken without yielding, so two steps in a row would otherwise hold the loop as one.
        await asyncio.sleep(0)
        try:
            async with asyncio.timeout(self.wait_s):
                await self._lock.acquire()
        except TimeoutError:  # the turns are held up: this step goes without one
            yield
            return
        try:
            yield
        finally:
            self._lock.release()
