"""The stream's reads are each bounded by their own timeout, though one timer serves them all:
a read gives up at its deadline, never at an earlier read's, and a cancellation that is not the
timer's is not taken for a timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grpc import aio

from extproc.request.stream import EnvoyStream

WAIT_S = 5


class Envoy:
    """A ServicerContext whose messages come when the test puts them."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()

    async def read(self) -> Any:
        return await self.inbox.get()


async def test_a_read_gives_up_at_its_timeout_and_the_stream_goes_on() -> None:
    envoy = Envoy()
    stream = EnvoyStream(envoy)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await asyncio.wait_for(stream.read(0.05), WAIT_S) is None
    assert loop.time() - started >= 0.05
    assert not stream.ended  # a timeout, not the stream's end
    envoy.inbox.put_nowait("next")
    assert await asyncio.wait_for(stream.read(WAIT_S), WAIT_S) == "next"
    envoy.inbox.put_nowait(aio.EOF)
    assert await asyncio.wait_for(stream.read(WAIT_S), WAIT_S) is None
    assert stream.ended
    stream.close()


async def test_a_later_deadline_is_kept_after_an_earlier_read_armed_the_timer() -> None:
    envoy = Envoy()
    stream = EnvoyStream(envoy)  # type: ignore[arg-type]
    envoy.inbox.put_nowait("first")
    assert await stream.read(0.05) == "first"  # arms the timer for 0.05 s from now
    loop = asyncio.get_running_loop()
    later = asyncio.ensure_future(stream.read(WAIT_S))
    await asyncio.sleep(0.2)  # the first read's deadline passes while this one waits
    assert not later.done()
    envoy.inbox.put_nowait("second")
    assert await asyncio.wait_for(later, WAIT_S) == "second"
    started = loop.time()
    assert await asyncio.wait_for(stream.read(0.05), WAIT_S) is None
    assert loop.time() - started >= 0.05
    stream.close()


async def test_a_cancelled_reader_is_cancelled_not_timed_out() -> None:
    stream = EnvoyStream(Envoy())  # type: ignore[arg-type]
    reading = asyncio.ensure_future(stream.read(WAIT_S))
    await asyncio.sleep(0)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    stream.close()
