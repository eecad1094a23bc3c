"""An event loop whose clock jumps to the next timer: simulated time, no waiting.

Everything scheduled runs in the order of its simulated time; while a step "takes" its modelled
time, nothing else runs, and no wall-clock time passes. A loop with nothing scheduled and
nothing ready is stuck (a request waits for an event that will never come): that raises, so a
simulation never hangs. No thread may hand work to this loop: it never waits for one.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["SimulationStuck", "VirtualLoop", "run_virtual"]

T = TypeVar("T")


class SimulationStuck(RuntimeError):
    """Nothing is scheduled and the simulation has not finished."""


class _Clock(selectors.SelectSelector):
    """A selector that never waits: it moves its loop's clock to the next timer instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise SimulationStuck("the simulation is stuck: nothing is scheduled")
        self.now += max(0.0, timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._clock = _Clock()
        super().__init__(self._clock)

    def time(self) -> float:
        return self._clock.now


def run_virtual(coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `coro()` to its end on a fresh virtual clock starting at 0."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro())
    finally:
        loop.close()
