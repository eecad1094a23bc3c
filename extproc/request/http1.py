"""The P leg's HTTP/1.1 connections: one POST at a time on each, kept alive and reused per
destination, the answer parsed by httptools (the llhttp parser uvicorn uses).

A P leg is always one shape: a POST of a JSON body, a small JSON answer. aiohttp, which the
rest of the sidecar uses, spent about a third of the ext_proc's own CPU per request on it
(measured in `bench/hotpath.py`; docs/benchmarks.md) and writes the body from a task of its
own, one event-loop turn after the leg starts. Here the request leaves in one write, in the
leg's own turn, and its answer is whole before it is handed over.

Connections are never shared between legs in flight (HTTP/1.1 has no multiplexing; a leg does
not queue behind another), and a connection whose answer did not complete (a broken, cancelled
or timed-out leg) is closed, never reused. Idle ones are closed after `keepalive_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httptools

from extproc.protocol.bodies import Spliced

__all__ = ["Answer", "BrokenConnection", "Connections", "Destination", "NotConnected", "head"]

# A body this long goes out as its pieces (a send each); a shorter one is joined first.
_PIECES_FROM = 1 << 20

# A P answer is a JSON object of a few hundred bytes: a larger one is an engine gone wrong,
# and is not held in memory.
MAX_ANSWER_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a connection goes: "host:port" over TCP, or a Unix socket's path."""

    key: str  # the pool's key and, over TCP, the Host header
    unix_path: str | None = None

    async def connect(self, protocol: _Connection) -> None:
        loop = asyncio.get_running_loop()
        if self.unix_path is not None:
            await loop.create_unix_connection(lambda: protocol, self.unix_path)
        else:
            host, _, port = self.key.rpartition(":")
            await loop.create_connection(lambda: protocol, host.strip("[]"), int(port))


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: dict[str, str]  # the headers asked for (lower-case names), as they came
    body: bytes


class NotConnected(Exception):
    """No connection: `error` the OS's reason, None when none came within the connect timeout."""

    def __init__(self, error: OSError | None) -> None:
        super().__init__(str(error) if error else "no connection in time")
        self.error = error


class BrokenConnection(Exception):
    """The connection closed, or sent what is not an HTTP answer, before the answer was whole."""


def head(path: str, host: str, headers: Mapping[str, str], body_bytes: int) -> bytes:
    """A POST's request line and headers. A value with a line break would smuggle a second
    request onto the connection: refused (Envoy never forwards one)."""
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", f"content-length: {body_bytes}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode()


class _Connection(asyncio.Protocol):
    """One connection and the answer it is reading (httptools calls the on_* methods)."""

    def __init__(self, wanted: frozenset[bytes]) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False  # the last answer was whole and the server keeps the connection
        self.idle_since = 0.0
        self._wanted = wanted
        self._parser: httptools.HttpResponseParser | None = None
        self._answer: asyncio.Future[Answer] | None = None
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0

    def request(self, data: bytes, body: bytes | Spliced = b"") -> asyncio.Future[Answer]:
        """Send `data`, then `body`: apart, and the body as views (its pieces), so that a long
        one is copied once (into the transport's buffer, for what the socket does not take at
        once) rather than also joined, to its head or from its pieces."""
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self._parser = httptools.HttpResponseParser(self)
        self._headers, self._body, self._size = {}, [], 0
        self.reusable = False
        self.transport.write(data)
        if isinstance(body, Spliced) and len(body) >= _PIECES_FROM:
            pieces = body.pieces  # no whole copy of a long body
        else:
            pieces = (bytes(body),)  # one write (one send), not one per member
        for piece in pieces:
            if piece:
                self.transport.write(memoryview(piece))
        return self._answer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(f"the connection closed before the answer was whole{_because(exc)}")

    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(f"the answer is not HTTP/1.1 ({error})")
            self.close()

    # httptools
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        if key in self._wanted:
            self._headers[key.decode("latin-1")] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_ANSWER_BYTES:
            self._fail(f"the answer exceeds {MAX_ANSWER_BYTES} bytes")
            self.close()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        parser, answer = self._parser, self._answer
        if parser is None or answer is None or answer.done():
            return
        self._parser = None
        self.reusable = parser.should_keep_alive()
        answer.set_result(Answer(parser.get_status_code(), self._headers, b"".join(self._body)))

    def _fail(self, why: str) -> None:
        self._parser = None
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(BrokenConnection(why))


def _because(exc: Exception | None) -> str:
    return f" ({exc})" if exc else ""


class Connections:
    """Kept-alive connections per destination; `post` uses an idle one or opens one."""

    def __init__(self, keepalive_s: float, headers: Iterable[str] = ()) -> None:
        self._keepalive_s = keepalive_s
        self._wanted = frozenset(name.lower().encode() for name in headers)
        self._idle: dict[str, deque[_Connection]] = {}
        self._busy: set[_Connection] = set()

    async def post(
        self,
        destination: Destination,
        request: bytes,
        connect_timeout_s: float,
        body: bytes | Spliced = b"",
    ) -> Answer:
        """Send `request` (its head, or head and body), then `body`, and read the whole
        answer. NotConnected when no connection was had; BrokenConnection when it ended
        without a whole answer."""
        connection = self._idle_connection(destination.key)
        if connection is None:
            connection = await self._connect(destination, connect_timeout_s)
        self._busy.add(connection)
        try:
            answer = await connection.request(request, body)
        except BaseException:
            connection.close()  # mid-answer (broken, cancelled, timed out): never reused
            raise
        finally:
            self._busy.discard(connection)
        if connection.reusable and not connection.closed:
            connection.idle_since = asyncio.get_running_loop().time()
            self._idle.setdefault(destination.key, deque()).append(connection)
        else:
            connection.close()
        return answer

    def _idle_connection(self, key: str) -> _Connection | None:
        """The most recently used idle connection still open and inside its keep-alive; the
        expired ones, oldest first, are closed on the way."""
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_kept = asyncio.get_running_loop().time() - self._keepalive_s
        while idle and (idle[0].closed or idle[0].idle_since < oldest_kept):
            idle.popleft().close()
        while idle:
            connection = idle.pop()
            if not connection.closed:  # the server may have closed it meanwhile
                return connection
        return None

    async def _connect(self, destination: Destination, timeout_s: float) -> _Connection:
        self._sweep()
        connection = _Connection(self._wanted)
        timeout = asyncio.timeout(timeout_s)
        try:
            async with timeout:
                await destination.connect(connection)
        except OSError as error:  # TimeoutError too: ours, or the kernel's ETIMEDOUT
            connection.close()
            raise NotConnected(None if timeout.expired() else error) from None
        return connection

    def _sweep(self) -> None:
        """Forget every idle connection that is closed or past its keep-alive, and the
        destinations left with none (an engine that left the pool is never asked for again).
        Done when a connection opens, which is rare next to the legs that reuse one."""
        oldest_kept = asyncio.get_running_loop().time() - self._keepalive_s
        for key, idle in list(self._idle.items()):
            for connection in [c for c in idle if c.closed or c.idle_since < oldest_kept]:
                idle.remove(connection)
                connection.close()
            if not idle:
                del self._idle[key]

    def close(self) -> None:
        """Close every connection; legs in flight fail as broken."""
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        for connection in list(self._busy):
            with contextlib.suppress(Exception):
                connection.close()
