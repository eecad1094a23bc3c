"""A scripted Envoy for the request processor (no sockets): the messages Envoy would send, built
here and fed by the test; every answer the processor writes recorded, and read back."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.request import envoy_msgs

P, P2 = "127.0.0.1:8100", "127.0.0.1:8101"
D1, D2 = "127.0.0.1:8200", "127.0.0.1:8201"
IDENTITY = {
    "remote_engine_id": "e1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "transfer_mode": "push",
}
P_ANSWER = IDENTITY | {
    "do_remote_prefill": True,
    "remote_block_ids": [[1, 2]],
    "remote_request_id": "cmpl-x",
}
REQUEST = {"model": "m", "prompt": "hello", "max_tokens": 4}
STREAMED_REQUEST = REQUEST | {"stream": True}
WAIT_S = 5  # a bound on every wait for the processor: a hang fails the test, never blocks it


class ScriptedEnvoy:
    """A grpc.aio ServicerContext stand-in: messages in from a queue, answers recorded.

    `timeline` records each answer's kind once written; a P leg stand-in sharing it adds its
    leg's steps, so a test sees their order.
    """

    def __init__(self, timeline: list[str] | None = None) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.sent: list[ep.ProcessingResponse] = []
        self.answered = asyncio.Event()
        self.timeline = [] if timeline is None else timeline

    async def read(self) -> Any:
        return await self.inbox.get()

    async def write(self, message: ep.ProcessingResponse) -> None:
        await asyncio.sleep(0)  # like grpc.aio's write: other tasks run while it flushes
        self.sent.append(message)
        self.timeline.append(message.WhichOneof("response"))
        self.answered.set()

    async def until_sent(self, count: int) -> list[ep.ProcessingResponse]:
        """Wait (bounded) until the processor has written `count` answers."""
        while len(self.sent) < count:
            self.answered.clear()
            await asyncio.wait_for(self.answered.wait(), WAIT_S)
        return self.sent

    async def until_kind(self, kind: str) -> None:
        """Wait (bounded) until the processor has written an answer of this kind."""
        while kind not in self.timeline:
            self.answered.clear()
            await asyncio.wait_for(self.answered.wait(), WAIT_S)

    def kinds(self) -> list[str | None]:
        return [m.WhichOneof("response") for m in self.sent]


# ---- what Envoy sends --------------------------------------------------------------------


def headers(path: str = "/v1/completions", end: bool = False, **extra: str) -> Any:
    """The request headers; `extra` adds headers (`x_request_id="c-1"` is x-request-id)."""
    pairs = [
        (":method", "POST"),
        (":path", path),
        ("content-type", "application/json"),
        *((k.replace("_", "-"), v) for k, v in extra.items()),
    ]
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=core.HeaderMap(
                headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            ),
            end_of_stream=end,
        )
    )


def body(doc: dict[str, Any]) -> Any:
    """The whole request body in one message (the buffered mode)."""
    return ep.ProcessingRequest(
        request_body=ep.HttpBody(body=orjson.dumps(doc), end_of_stream=True)
    )


def response_headers(status: int) -> Any:
    """D's answer headers, as Envoy forwards them."""
    header = core.HeaderValue(key=":status", raw_value=str(status).encode())
    return ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=core.HeaderMap(headers=[header]))
    )


# ---- what the processor answers -------------------------------------------------------------


def routed(message: ep.ProcessingResponse) -> tuple[dict[str, Any], dict[str, str]]:
    """The body answer's new body and the headers it sets."""
    answer = message.request_body.response
    set_headers = {
        h.header.key: h.header.raw_value.decode() for h in answer.header_mutation.set_headers
    }
    return orjson.loads(answer.body_mutation.body), set_headers


def error(message: ep.ProcessingResponse) -> tuple[int, str, str | None]:
    """An immediate response's status, error message and retry-after header."""
    reply = message.immediate_response
    retry = {h.header.key: h.header.raw_value.decode() for h in reply.headers.set_headers}
    return reply.status.code, orjson.loads(reply.body)["error"]["message"], retry.get("retry-after")


def labels(message: Any) -> dict[str, Any]:
    """The request's labels a ProcessingResponse gives Envoy (its dynamic metadata)."""
    namespace = message.dynamic_metadata.fields[envoy_msgs.LABELS_NAMESPACE].struct_value
    return {key: value.string_value for key, value in namespace.fields.items()}
