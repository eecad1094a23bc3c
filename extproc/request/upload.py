"""The client's body as Envoy streams it (FULL_DUPLEX_STREAMED), gathered whole.

Envoy neither buffers nor times a streamed body, so the limits are enforced here: the body
limit as soon as the chunks exceed it (413, before any leg leaves), the process's budget of
bodies (`extproc.request.body_budget`: 503 + Retry-After before more is read), a stalled
upload after `idle_s` without a chunk and a slow one after `whole_s` in all (408). HTTP/1.1
clients end the body with an extra empty end-of-stream chunk; a body with trailers ends with
the trailers message instead. The chunks are kept in pieces of about a MiB and joined once
whole: a buffer grown chunk by chunk is moved and copied as it grows, and in glibc's heap, where
large buffers stay warm (`extproc.process.memory`), the places it moved out of were left behind
while other uploads grew, held uploads costing 1.3-1.6 x what they had sent.

What a held upload costs is what it has sent: while it waits for its next chunk nothing else
of it is kept (Envoy sends chunks of megabytes when it has buffered them: the last message and
its body kept beside the chunks made a held upload cost about twice its size). The one copy,
joining the chunks at the end, is about 1 ms per 10 MB in warm memory.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.errors import ClientError
from extproc.protocol.bodies import Raw

if TYPE_CHECKING:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.request.body_budget import Reservation
    from extproc.request.stream import EnvoyStream

__all__ = ["Upload", "UploadLimits", "gather_body"]

_PIECE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Upload:
    body: Raw  # the chunks joined (a body of one chunk: that chunk)
    trailers: bool = False  # the body ended with trailers (the processor refuses them)
    # Envoy's own reply arrived instead of the body's end (it answered the client itself)
    envoy_reply: ep.ProcessingRequest | None = None


@dataclass(frozen=True, slots=True)
class UploadLimits:
    body_bytes: int  # this body (413)
    budget_bytes: int  # every body the process holds (503)
    idle_s: float  # longest silence between chunks (408)
    whole_s: float  # longest upload, from its headers (408)


async def gather_body(
    stream: EnvoyStream, limits: UploadLimits, reserved: Reservation
) -> Upload | None:
    """The whole body, or None when the stream ended first (the client went away). Its bytes
    are taken from the budget into `reserved` as they arrive."""
    gathered = _Gathered(limits, reserved)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.whole_s
    while True:
        left_s = deadline - loop.time()
        message = await stream.read(min(limits.idle_s, max(left_s, 0.0)))
        if message is None:
            if stream.ended:
                return None
            raise _too_slow(limits, gathered.size, left_s)
        kind = message.WhichOneof("request")
        if kind == "request_trailers":
            return Upload(gathered.whole(), trailers=True)
        if kind != "request_body":
            return Upload(b"", envoy_reply=message)
        end = message.request_body.end_of_stream
        gathered.add(message.request_body.body)
        message = None  # the chunk's message goes now, not once the next one has come
        if end:
            return Upload(gathered.whole())


class _Gathered:
    """The chunks so far: a chunk of a MiB or more kept as it came (a body of one chunk is
    never copied), smaller ones gathered into pieces of about a MiB (a chunk's own object costs
    ~40 bytes: a million 1-byte chunks, kept apart, would cost 40 times what they hold)."""

    __slots__ = ("_limits", "_pieces", "_reserved", "_tail", "size")

    def __init__(self, limits: UploadLimits, reserved: Reservation) -> None:
        self._limits = limits
        self._reserved = reserved
        self._pieces: list[Raw] = []
        self._tail: Raw = b""  # the piece being gathered
        self.size = 0

    def add(self, body: bytes) -> None:
        if not body:
            return
        self.size += len(body)
        if self.size > self._limits.body_bytes:
            raise ClientError(
                413, f"request body exceeds the limit of {self._limits.body_bytes} bytes"
            )
        self._reserved.take(len(body), self._limits.budget_bytes)
        if len(body) >= _PIECE_BYTES:
            self._seal()
            self._pieces.append(body)
            return
        if not self._tail:
            self._tail = body
        else:
            if isinstance(self._tail, bytes):
                self._tail = bytearray(self._tail)
            self._tail += body
        if len(self._tail) >= _PIECE_BYTES:
            self._seal()

    def _seal(self) -> None:
        if self._tail:
            self._pieces.append(self._tail)
            self._tail = b""

    def whole(self) -> Raw:
        self._seal()
        pieces, self._pieces = self._pieces, []
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)


def _too_slow(limits: UploadLimits, size: int, left_s: float) -> ClientError:
    if left_s <= limits.idle_s:
        return ClientError(
            408,
            f"the request body took longer than {limits.whole_s:g} s to arrive ({size} bytes "
            "came); send it faster",
        )
    return ClientError(
        408,
        f"the request body stalled: nothing arrived for {limits.idle_s:g} s "
        f"after {size} bytes; send the whole body without pausing",
    )
