"""The P leg's HTTP/1.1 connections against a scripted loopback server: each test says what
the server writes back, byte for byte, and checks what the client makes of it and whether the
connection is used again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from extproc.protocol.bodies import Spliced
from extproc.request.http1 import (
    MAX_ANSWER_BYTES,
    Answer,
    BrokenConnection,
    Connections,
    Destination,
    NotConnected,
    head,
)

WAIT_S = 5
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-flags: UF\r\n\r\n{}"
Script = Callable[[bytes], bytes | None]  # the request's bytes → the answer (None: hang up)


class ScriptedServer:
    """Answers each request on a connection with `script(request)`; counts connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.destination = Destination("")
        self.hang_up_after = False  # close the connection after the next answer
        self.closed_by_client = asyncio.Event()  # a connection reached its end of stream

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while request := await reader.readuntil(b"{}"):  # every test body is b"{}"
                self.requests.append(request)
                answer = self.script(request)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if self.hang_up_after:
                    self.hang_up_after = False
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    scripted = ScriptedServer(lambda request: OK)
    # a request of up to 4 MiB read whole (a body as its pieces is one of a MiB)
    listening = await asyncio.start_server(scripted.handle, "127.0.0.1", 0, limit=4 << 20)
    port = listening.sockets[0].getsockname()[1]
    scripted.destination = Destination(f"127.0.0.1:{port}")
    yield scripted
    listening.close()
    await listening.wait_closed()


def request() -> bytes:
    return head("/v1/completions", "p", {"x-request-id": "r"}, 2) + b"{}"


async def post(connections: Connections, server: ScriptedServer) -> Answer:
    return await asyncio.wait_for(connections.post(server.destination, request(), WAIT_S), WAIT_S)


async def test_an_answer_is_read_whole_and_its_connection_reused(server: ScriptedServer) -> None:
    connections = Connections(60, headers=("X-Flags",))
    try:
        first = await post(connections, server)
        second = await post(connections, server)
    finally:
        connections.close()
    assert first == second
    assert (first.status, first.headers, first.body) == (200, {"x-flags": "UF"}, b"{}")
    assert server.connections == 1
    assert server.requests[0] == (
        b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-length: 2\r\n"
        b"x-request-id: r\r\n\r\n{}"
    )


@pytest.mark.parametrize("size", [16, 1 << 20], ids=["joined", "as-its-pieces"])
async def test_a_spliced_body_goes_out_whole_after_its_head(
    server: ScriptedServer, size: int
) -> None:
    """A P body kept as its pieces (views into the client's body): a short one joined into
    one write, a long one written piece by piece; the server reads the same bytes."""
    body = Spliced((b'"', memoryview(b"x" * size), b'"', b"{}"), size + 4)
    data = head("/v1/completions", "p", {"x-request-id": "r"}, len(body))
    connections = Connections(60)
    try:
        answer = await asyncio.wait_for(
            connections.post(server.destination, data, WAIT_S, body), WAIT_S
        )
    finally:
        connections.close()
    assert answer.status == 200
    assert server.requests == [data + bytes(body)]


async def test_a_chunked_answer_is_joined(server: ScriptedServer) -> None:
    server.script = lambda request: (
        b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{"a\r\n5\r\n": 1}\r\n0\r\n\r\n'
    )
    connections = Connections(60)
    try:
        answer = await post(connections, server)
    finally:
        connections.close()
    assert answer.body == b'{"a": 1}'


async def test_an_answer_that_closes_its_connection_is_not_reused(server: ScriptedServer) -> None:
    server.script = lambda request: OK.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    connections = Connections(60)
    try:
        await post(connections, server)
        await post(connections, server)
    finally:
        connections.close()
    assert server.connections == 2


async def test_a_leg_given_up_mid_answer_closes_its_connection(server: ScriptedServer) -> None:
    partial = b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"kv'
    server.script = lambda request: partial  # and the rest never comes
    connections = Connections(60)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(connections.post(server.destination, request(), WAIT_S), 0.3)
        await asyncio.wait_for(server.closed_by_client.wait(), WAIT_S)  # closed, not left open
        server.script = lambda request: OK
        answer = await post(connections, server)
    finally:
        connections.close()
    assert answer.status == 200
    assert server.connections == 2  # the half-read connection was closed, not used again


async def test_a_connection_closed_mid_answer_fails_the_leg(server: ScriptedServer) -> None:
    server.script = lambda request: b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"kv'
    server.hang_up_after = True
    connections = Connections(60)
    try:
        with pytest.raises(BrokenConnection, match="closed before the answer was whole"):
            await post(connections, server)
        server.script = lambda request: OK
        await post(connections, server)  # a new connection, not the broken one
    finally:
        connections.close()
    assert server.connections == 2


async def test_an_answer_over_the_bound_is_refused_not_held(server: ScriptedServer) -> None:
    size = MAX_ANSWER_BYTES + 1
    big = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + b"x" * size
    server.script = lambda request: big
    connections = Connections(60)
    try:
        with pytest.raises(BrokenConnection, match="exceeds"):
            await post(connections, server)
    finally:
        connections.close()


async def test_what_is_not_http_is_a_broken_connection(server: ScriptedServer) -> None:
    server.script = lambda request: b"SSH-2.0-OpenSSH\r\n\r\n"
    connections = Connections(60)
    try:
        with pytest.raises(BrokenConnection, match="not HTTP"):
            await post(connections, server)
    finally:
        connections.close()


async def test_no_listener_is_not_connected_with_the_os_reason() -> None:
    connections = Connections(60)
    with pytest.raises(NotConnected) as caught:
        await connections.post(Destination("127.0.0.1:1"), request(), WAIT_S)
    assert isinstance(caught.value.error, ConnectionRefusedError)


def test_a_header_with_a_line_break_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        head("/v1/completions", "p", {"x-forwarded": "a\r\nGET / HTTP/1.1"}, 2)


async def test_a_destination_with_no_open_connection_left_is_forgotten(
    server: ScriptedServer,
) -> None:
    server.script = lambda request: OK.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    gone = ScriptedServer(lambda request: OK)
    listening = await asyncio.start_server(gone.handle, "127.0.0.1", 0)
    gone.destination = Destination(f"127.0.0.1:{listening.sockets[0].getsockname()[1]}")
    connections = Connections(keepalive_s=0)  # every idle connection is past its keep-alive
    try:
        await post(connections, gone)  # kept for reuse: the server keeps it open
        listening.close()
        await post(connections, server)  # opening a connection sweeps the expired one
        assert connections._idle == {}  # white-box: what the sweep leaves is the point
    finally:
        connections.close()
        await listening.wait_closed()
