"""One Envoy ext_proc gRPC stream (= one HTTP request), read with at most one read pending.

A message is read by awaiting the stream itself (`read`), except where the processor must
wait on "Envoy's next message" and "the P leg finished" at once: there the read is kept as a
task (`next_message`), so that no message is ever lost, and cancelled on close. A task and an
`asyncio.wait` per message cost more of the request's CPU than all of its planning.
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
        pending, self._pending = self._pending, None
        timeout = asyncio.timeout(timeout_s)
        try:
            async with timeout:
                message = await (self._context.read() if pending is None else pending)
        except Exception:  # as a failed read task: the stream is gone
            if timeout.expired():
                return None
            message = None
        return self._received(message)

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
