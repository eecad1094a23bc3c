"""The P leg's failures against real loopback sockets: a prefill listener that cannot be
connected to is reported as unreachable (503, retryable) at once, and the prefill timeout only
once that timeout has elapsed."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest

from extproc.config import parse_config
from extproc.errors import ListenerUnreachable, PrefillTimeout
from extproc.request.prefill_client import PrefillCall, PrefillClient, ThroughListener

# the legs' config snapshot: nothing in it changes a leg through the listener
CONFIG = parse_config(
    {"prefill": {"endpoints": ["10.0.0.7:8100"]}, "decode": {"endpoints": ["10.0.0.8:8200"]}}
)
CONNECT_S = 0.2
PREFILL_S = 3.0


def address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


@contextlib.asynccontextmanager
async def client(listener: str) -> AsyncIterator[PrefillClient]:
    prefill = PrefillClient(ThroughListener(listener, CONNECT_S))
    try:
        yield prefill
    finally:
        await prefill.close()


async def send(prefill: PrefillClient) -> tuple[BaseException, float]:
    started = time.perf_counter()
    with pytest.raises((ListenerUnreachable, PrefillTimeout)) as caught:
        await prefill.send(
            PrefillCall("127.0.0.1:8100", "/v1/completions", b"{}", "r", PREFILL_S, CONFIG)
        )
    return caught.value, time.perf_counter() - started


@contextlib.asynccontextmanager
async def listener_that_never_accepts() -> AsyncIterator[str]:
    """A listening socket whose accept queue is full: a further connect hangs."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        queued = []
        try:
            for _ in range(8):  # the kernel queues a connection or two, then drops SYNs
                try:
                    queued.append(
                        await asyncio.wait_for(
                            asyncio.open_connection(*server.getsockname()), CONNECT_S
                        )
                    )
                except TimeoutError:
                    break
            else:
                pytest.skip("the kernel kept accepting connections into a full queue")
            yield address(server)
        finally:
            for _, writer in queued:
                writer.close()


async def test_connect_timeout_is_unreachable_not_the_prefill_timeout() -> None:
    async with listener_that_never_accepts() as listener, client(listener) as prefill:
        error, elapsed = await send(prefill)
    assert isinstance(error, ListenerUnreachable), error
    assert error.status == 503 and error.retry_after_s == 1
    assert f"did not accept a connection within {CONNECT_S:g} s" in error.message
    assert elapsed < PREFILL_S / 2


async def test_refused_connection_is_unreachable() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        async with client(address(unused)) as prefill:
            error, elapsed = await send(prefill)
    assert isinstance(error, ListenerUnreachable), error
    assert error.status == 503 and "prefill listener is unreachable" in error.message
    assert elapsed < PREFILL_S / 2


async def test_prefill_timeout_only_after_it_elapsed() -> None:
    async def read_and_stay_silent(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up

    server = await asyncio.start_server(read_and_stay_silent, "127.0.0.1", 0)
    async with server, client(address(server.sockets[0])) as prefill:
        error, elapsed = await send(prefill)
    assert isinstance(error, PrefillTimeout), error
    assert error.status == 504 and f"did not answer within {PREFILL_S:g} s" in error.message
    assert elapsed >= PREFILL_S
