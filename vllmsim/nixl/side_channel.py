"""TCP side channel with length-prefixed msgpack frames.

Stands in for vLLM's ZMQ handshake socket *and* the NIXL notifications: every message
is a dict with a "type" (handshake, pull_read, push_reg, write_done), sent as a 4-byte
big-endian length plus msgpack, and answered with one reply frame on the same
connection. One connection carries one request/reply pair.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
_LEN = struct.Struct(">I")
_MAX_FRAME = 16 * 1024 * 1024


class SideChannelError(Exception):
    """The peer is unreachable, closed the connection or sent garbage."""


class SideChannelBindError(OSError):
    """The side channel's own port cannot be bound (another engine on this host has it)."""

    def __init__(self, host: str, port: int, error: OSError) -> None:
        # asyncio's own text repeats the address: keep only the reason ("address already in use")
        reason = os.strerror(error.errno).lower() if error.errno else str(error)
        super().__init__(error.errno, reason)
        self.host, self.port = host, port


async def write_frame(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    data = msgpack.packb(msg, use_bin_type=True)
    writer.write(_LEN.pack(len(data)) + data)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > _MAX_FRAME:
        raise SideChannelError(f"frame too large: {size}")
    msg = msgpack.unpackb(await reader.readexactly(size), raw=False)
    if not isinstance(msg, dict):
        raise SideChannelError("frame is not a map")
    return msg


async def request(
    host: str,
    port: int,
    msg: dict[str, Any],
    latency_s: float,
    timeout: float | None = 30.0,  # noqa: ASYNC109
) -> dict[str, Any]:
    """Send one message and wait for its reply; `latency_s` models the one-way trip."""
    if latency_s > 0:
        await asyncio.sleep(latency_s)
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                await write_frame(writer, msg)
                return await read_frame(reader)
            finally:
                writer.close()
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        raise SideChannelError(f"{host}:{port}: {exc!r}") from exc


class SideChannelServer:
    """Accepts connections and hands each message to the current handler."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler  # swapped on a simulated restart
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, host, port)
        except OSError as error:
            raise SideChannelBindError(host, port, error) from error

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            msg = await read_frame(reader)
            reply = await self.handler(msg)
            await write_frame(writer, reply)
        except (asyncio.IncompleteReadError, ConnectionError, SideChannelError) as exc:
            log.debug("side channel connection dropped: %r", exc)
        finally:
            self._conns.discard(task)
            writer.close()
