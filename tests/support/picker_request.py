"""One request through the processor in endpoint-picker mode, against a scripted gateway Envoy
(streamed bodies both ways, metadata in and out) and a P leg the test controls."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as modes
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from grpc import aio

from extproc.request.processor import RequestProcessor
from extproc.request.stream import EnvoyStream
from extproc.tracing import RequestTrace
from extproc.wiring import Runtime
from tests.support.routing import fixed_routing_config
from tests.support.scripted_envoy import STREAMED_REQUEST as REQUEST
from tests.support.scripted_envoy import WAIT_S, ScriptedEnvoy, headers
from tests.support.scripted_prefill import ScriptedPrefill

P1, P2 = "127.0.0.1:8100", "127.0.0.1:8101"
D1, D2, D3 = "127.0.0.1:8200", "127.0.0.1:8201", "127.0.0.1:8202"
DESTINATION = "x-gateway-destination-endpoint"
SUBSET_HINT = ("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset")


class ClientContext(RequestTrace):
    """A trace that keeps the client's trace context it was given."""

    def __init__(self) -> None:
        self.joined: list[tuple[str | None, str | None]] = []

    def join_client(self, traceparent: str | None, tracestate: str | None) -> None:
        self.joined.append((traceparent, tracestate))


class PickerRequest:
    def __init__(self, picker_mode: bool = True, **config: Any) -> None:
        config = {
            "prefill": {"endpoints": [P1, P2]},
            "decode": {"endpoints": [D1, D2, D3]},
            "dispatch": {"probe": False},
            **config,
        }
        self.rt = Runtime(fixed_routing_config(config), "", endpoint_picker=picker_mode)
        self.prefill = ScriptedPrefill()
        self.trace = ClientContext()
        deps = self.rt.request_deps
        legs = dataclasses.replace(deps.legs, prefill_client=self.prefill)
        self.rt.request_deps = dataclasses.replace(deps, legs=legs, new_trace=lambda: self.trace)
        self.envoy = ScriptedEnvoy()
        stream = EnvoyStream(self.envoy)  # type: ignore[arg-type]
        self.task = asyncio.create_task(RequestProcessor(self.rt.request_deps, stream).run())

    async def send(self, *messages: Any) -> None:
        for message in messages:
            await self.envoy.inbox.put(message)

    async def start(self, subset: Any = None, **header_values: str) -> None:
        opening = headers(**header_values)
        opening.protocol_config.request_body_mode = modes.ProcessingMode.FULL_DUPLEX_STREAMED
        opening.protocol_config.response_body_mode = modes.ProcessingMode.FULL_DUPLEX_STREAMED
        if subset is not None:
            with_hint(opening, subset)
        raw = orjson.dumps(REQUEST)
        await self.send(opening, chunk(raw[:10], False), chunk(raw[10:], True))

    async def end(self) -> None:
        await self.send(aio.EOF)
        await asyncio.wait_for(self.task, WAIT_S)

    def requests(self, **labels: str) -> float | None:
        return self.rt.metrics.registry.get_sample_value("pd_extproc_requests_total", labels)


def with_hint(opening: Any, subset: struct_pb2.Value) -> None:
    namespace, key = SUBSET_HINT
    opening.metadata_context.filter_metadata[namespace].fields[key].CopyFrom(subset)


def chunk(data: bytes, end: bool) -> Any:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))


def response_chunk(data: bytes, end: bool) -> Any:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data, end_of_stream=end))


def strings(*values: str) -> struct_pb2.Value:
    listed = struct_pb2.ListValue(values=[struct_pb2.Value(string_value=v) for v in values])
    return struct_pb2.Value(list_value=listed)


def destination(answer: ep.ProcessingResponse, namespace: str = "envoy.lb") -> tuple[str, str]:
    """(the header, the `namespace` metadata) of the headers' answer."""
    mutation = answer.request_headers.response.header_mutation
    header = next(
        h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION
    )
    lb = answer.dynamic_metadata.fields[namespace].struct_value.fields
    return header, lb[DESTINATION].string_value
