"""One Envoy ext_proc gRPC stream (= one HTTP request), read with at most one read pending.

A message is read by awaiting the stream itself (`read`), except where the processor must
wait on "Envoy's next message" and "the P leg finished" at once: there the read is kept as a
task (`next_message`), so that no message is ever lost, and cancelled on close. A task and an
`asyncio.wait` per message cost more of the request's CPU than all of its planning.

Each read is bounded, by one timer per stream rather than one per read (an `asyncio.timeout`
per message was the largest cost left): a read sets its deadline, the timer is moved only to
an earlier one, and when it fires before a later deadline it is set again for that one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc import aio

__all__ = ["EnvoyStream"]


class EnvoyStream:
    def __init__(self, context: aio.ServicerContext[Any, Any]) -> None:
        self._context = context
        self._pending: asyncio.Future[Any] | None = None
        self.ended = False
        self._deadline = 0.0  # when the read in progress gives up (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self._reader: asyncio.Task[Any] | None = None  # the task inside `read`, if any
        self._expired = False  # the timer cancelled `_reader`: its read timed out

    def next_message(self) -> asyncio.Future[Any]:
        """The task reading Envoy's next message (created once, reused until consumed)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._context.read())
        return self._pending

    def take(self) -> ep.ProcessingRequest | None:
        """The message of a finished `next_message()` task; None when the stream ended."""
        task, self._pending = self._pending, None
        assert task is not None and task.done()
        message = None if task.cancelled() or task.exception() else task.result()
        return self._received(message)

    def put_back(self, message: ep.ProcessingRequest) -> None:
        """A message taken before it could be answered (a streamed response body chunk while
        D's headers are held): `next_message()` gives it again, first."""
        assert self._pending is None
        self._pending = asyncio.get_running_loop().create_future()
        self._pending.set_result(message)

    async def read(self, timeout_s: float) -> ep.ProcessingRequest | None:
        """Envoy's next message, or None when the stream ended or nothing came in time."""
        # A read already running (or a message put back) is awaited, else the stream; a
        # timeout cancels the read: every caller ends the request then.
        self._arm(timeout_s)
        pending, self._pending = self._pending, None
        reader = self._reader = asyncio.current_task()
        assert reader is not None  # always called from a task
        try:
            message = await (self._context.read() if pending is None else pending)
        except asyncio.CancelledError:
            if not self._expired:
                raise
            self._expired = False
            reader.uncancel()
            return None
        except Exception:  # as a failed read task: the stream is gone
            message = None
        finally:
            self._reader = None
        return self._received(message)

    def _arm(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout_s
        timer = self._timer
        if timer is None or timer.when() > self._deadline:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(self._deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        reader = self._reader
        if reader is None:  # no read waits now: the next one sets the timer again
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:  # this read's deadline is later than the last one's
            self._timer = loop.call_at(self._deadline, self._on_timer)
            return
        self._expired = True
        reader.cancel()

    def _received(self, message: Any) -> ep.ProcessingRequest | None:
        if message is None or message is aio.EOF:
            self.ended = True
            return None
        return message

    async def write(self, response: ep.ProcessingResponse) -> None:
        await self._context.write(response)

    def close(self) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        self._pending = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
