"""A round of background work repeated every interval by one owned task.

The health checker's siblings (engine scraper, discovery) all need the same thing: run a
round, sleep, repeat; survive a round that fails unexpectedly (a bug must not silently stop the
loop); stop by cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from extproc.stopping import cancel_and_wait

__all__ = ["Periodic"]

log = logging.getLogger("extproc")


class Periodic:
    def __init__(
        self, name: str, round_: Callable[[], Awaitable[None]], interval_s: Callable[[], float]
    ) -> None:
        self.name = name
        self._round = round_
        self._interval_s = interval_s  # re-read every round: a reload may change it
        self._task: asyncio.Task[None] | None = None

    def start(self, first_now: bool) -> None:
        self._task = asyncio.create_task(self._loop(first_now), name=self.name)

    async def _loop(self, first_now: bool) -> None:
        if not first_now:
            await asyncio.sleep(self._interval_s())
        while True:
            try:
                await self._round()
            except Exception:  # a bug in one round must not end the loop
                log.exception("%s: round failed", self.name)
            await asyncio.sleep(self._interval_s())

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
