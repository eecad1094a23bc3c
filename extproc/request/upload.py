"""The client's body as Envoy streams it (FULL_DUPLEX_STREAMED), gathered whole.

Envoy neither buffers nor times a streamed body, so the limits are enforced here: the body
limit as soon as the chunks exceed it (413, before any leg leaves) and a stalled upload after
`idle_s` without a chunk (408). HTTP/1.1 clients end the body with an extra empty
end-of-stream chunk; a body with trailers ends with the trailers message instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from extproc.errors import ClientError

if TYPE_CHECKING:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.request.stream import EnvoyStream

__all__ = ["Upload", "gather_body"]


@dataclass(frozen=True, slots=True)
class Upload:
    body: bytes
    trailers: bool = False  # the body ended with trailers (the processor refuses them)
    # Envoy's own reply arrived instead of the body's end (it answered the client itself)
    envoy_reply: ep.ProcessingRequest | None = None


async def gather_body(stream: EnvoyStream, limit: int, idle_s: float) -> Upload | None:
    """The whole body, or None when the stream ended first (the client went away)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await stream.read(idle_s)
        if message is None:
            if stream.ended:
                return None
            raise ClientError(
                408,
                f"the request body stalled: nothing arrived for {idle_s:g} s "
                f"after {size} bytes; send the whole body without pausing",
            )
        kind = message.WhichOneof("request")
        if kind == "request_trailers":
            return Upload(b"".join(chunks), trailers=True)
        if kind != "request_body":
            return Upload(b"", envoy_reply=message)
        chunk = message.request_body
        if chunk.body:
            size += len(chunk.body)
            if size > limit:
                raise ClientError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk.body)
        if chunk.end_of_stream:
            return Upload(chunks[0] if len(chunks) == 1 else b"".join(chunks))
