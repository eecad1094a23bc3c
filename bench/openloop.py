"""Open-loop load: send at a fixed rate whatever the answers do, and time each request.

A closed loop (send the next request when one finishes) slows down with the system under
test and hides its queueing; a fixed schedule does not.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadResult:
    latencies: list[float]  # seconds, one per request, in send order
    target_rate: float
    achieved_rate: float  # what the client managed to send (below target: client-limited)
    errors: int


async def open_loop(
    run: Callable[[], Awaitable[float]], rate: float, seconds: float, timeout_s: float = 30.0
) -> LoadResult:
    """Start `run()` every 1/rate s for `seconds`; each returns its own latency in seconds."""
    count = max(1, int(rate * seconds))
    start = time.perf_counter() + 0.02
    tasks: list[asyncio.Task[float]] = []
    for i in range(count):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(asyncio.wait_for(run(), timeout_s)))
    sent_in = max(time.perf_counter() - start, 1e-9)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    latencies = [r for r in results if isinstance(r, float)]
    achieved = (count - 1) / sent_in if count > 1 else rate
    return LoadResult(latencies, rate, achieved, len(results) - len(latencies))


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
