"""The memory big request bodies were copied through goes back to the system once they are gone.

The heap keeps freed buffers warm for the next bodies (`extproc.process.memory`); a burst of
big bodies would otherwise leave the process as large as at the burst's peak for good. Once the
budget's last big body is given back and none has come for `quiet_s` (a burst's next bodies
reuse the memory meanwhile), the heap's free memory is returned: on a thread, since the trim
takes milliseconds, and never for small bodies, which do not grow the heap enough to matter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from extproc.process.memory import give_back_free_memory
from extproc.request.body_budget import BodyBudget
from extproc.stopping import cancel_and_wait

__all__ = ["MemoryTrim"]

log = logging.getLogger("extproc")

QUIET_S = 1.0


class MemoryTrim:
    """Trims the heap after the big bodies of `bodies` are gone; `start`, then `stop`."""

    def __init__(
        self,
        bodies: BodyBudget,
        quiet_s: float = QUIET_S,
        trim: Callable[[], object] = give_back_free_memory,
    ) -> None:
        self._bodies = bodies
        self._quiet_s = quiet_s
        self._trim = trim
        self._due = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        bodies.on_big_bodies_gone = self._due.set

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="memory-trim")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def once(self) -> bool:
        """Wait for the big bodies to be gone, then quiet for `quiet_s`, and trim; False when
        another big body came meanwhile (its end calls for the next trim)."""
        await self._due.wait()
        self._due.clear()
        await asyncio.sleep(self._quiet_s)
        if self._bodies.big:
            return False
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.to_thread(self._trim)
        log.debug("free memory given back to the system in %.1f ms", (loop.time() - started) * 1e3)
        return True

    async def _run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception:  # never expected; the next bodies' end tries again
                log.exception("giving free memory back to the system failed")
