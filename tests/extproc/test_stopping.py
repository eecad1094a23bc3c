"""cancel_and_wait: owned tasks end even when one loses a cancellation, and never block a stop
for longer than its patience."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from extproc.stopping import cancel_and_wait


class LosesCancellations:
    """A loop that carries on after its first `lost` cancellations, as a loop around Python
    3.11's wait_for can."""

    def __init__(self, lost: int) -> None:
        self.lost = lost
        self.cancels = 0

    async def run(self) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancels += 1
                if self.cancels > self.lost:
                    raise


async def test_a_task_that_lost_its_cancellation_is_cancelled_again() -> None:
    loop = LosesCancellations(lost=1)
    task = asyncio.create_task(loop.run())
    await asyncio.sleep(0)  # let it reach its sleep
    await asyncio.wait_for(cancel_and_wait([task], recancel_after_s=0.05), 5)
    assert task.cancelled()
    assert loop.cancels == 2


async def test_patience_bounds_the_wait_and_says_which_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = LosesCancellations(lost=10**6)
    stubborn = asyncio.create_task(loop.run(), name="stubborn")
    done = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(cancel_and_wait([stubborn, done, None], 0.02, patience_s=0.2), 5)
    assert not stubborn.done()
    assert loop.cancels >= 2  # cancelled again and again until patience ran out
    assert any(
        "'stubborn' did not end within 0.2 s" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR
    )
    loop.lost = 0  # the test's own clean-up: the next cancel ends it
    stubborn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stubborn


async def test_a_failure_of_an_ended_task_is_retrieved_not_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    unretrieved: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        task: asyncio.Task[None] | None = asyncio.create_task(fails())
        assert task is not None
        await asyncio.wait({task})
        await cancel_and_wait([task])  # no raise
        task = None
        gc.collect()  # a task whose failure nobody read reports it when it is collected
        assert unretrieved == []
    finally:
        loop.set_exception_handler(None)
