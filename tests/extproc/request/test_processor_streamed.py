"""The processor with a streamed request body (FULL_DUPLEX_STREAMED, the LLM routes), against
a scripted Envoy: chunks gathered while the headers wait, then the headers' answer and the new
body; the limits the ext_proc owns in this mode; the guarantees of the buffered path kept."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2 as core
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc import aio

from extproc.errors import PrefillFailed
from extproc.request.processor import RequestProcessor
from extproc.request.stream import EnvoyStream
from tests.support.polling import until_true
from tests.support.scripted_envoy import (
    D1,
    IDENTITY,
    REQUEST,
    ScriptedEnvoy,
    headers,
    response_headers,
)
from tests.support.scripted_prefill import ScriptedPrefill, run, runtime

SAME = IDENTITY | {"remote_request_id": "x"}  # P's answer: the engine D was given
STREAMED = ep.ProtocolConfiguration(request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED)


def streamed_headers(extra: dict[str, str] | None = None) -> ep.ProcessingRequest:
    message = headers()
    for key, value in (extra or {}).items():
        message.request_headers.headers.headers.append(
            core.HeaderValue(key=key, raw_value=value.encode())
        )
    message.protocol_config.CopyFrom(STREAMED)
    return message


def chunk(data: bytes, end: bool = False) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))


async def upload(envoy: ScriptedEnvoy, doc: dict[str, Any], pieces: int = 3) -> None:
    """The headers, the body in `pieces` chunks, then HTTP/1.1's empty end-of-stream chunk."""
    raw = orjson.dumps(doc)
    await envoy.inbox.put(streamed_headers({"x-gateway-destination-endpoint": "10.9.9.9:1"}))
    step = -(-len(raw) // pieces)
    for start in range(0, len(raw), step):
        await envoy.inbox.put(chunk(raw[start : start + step]))
    await envoy.inbox.put(chunk(b"", end=True))


def set_headers(answer: ep.ProcessingResponse) -> dict[str, str]:
    mutation = answer.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def kinds(envoy: ScriptedEnvoy) -> list[str | None]:
    return [m.WhichOneof("response") for m in envoy.sent]


async def test_headers_are_answered_once_the_body_is_in_then_the_new_body() -> None:
    timeline: list[str] = []
    envoy = ScriptedEnvoy(timeline)
    rt = runtime(ScriptedPrefill(SAME, compute_s=0.05, timeline=timeline), cached=True)
    task = await run(rt, envoy)
    await upload(envoy, REQUEST | {"kv_transfer_params": {"remote_host": "evil"}})
    await envoy.until_sent(2)
    # P leaves before D's answers are written (parallel), and nothing is answered earlier
    assert timeline[:4] == ["P leg created", "P leg sent", "request_headers", "request_body"]
    routing = set_headers(envoy.sent[0])
    streamed = envoy.sent[1].request_body.response.body_mutation.streamed_response
    assert streamed.end_of_stream
    assert routing["x-gateway-destination-endpoint"] == D1  # the client's value overwritten
    assert int(routing["content-length"]) == len(streamed.body)
    params = orjson.loads(streamed.body)["kv_transfer_params"]
    assert params["remote_engine_id"] == "e1" and "evil" not in streamed.body.decode()
    assert params["remote_request_id"] == routing["x-request-id"]
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)
    assert rt.active_streams == 0 and all(e.in_flight == 0 for e in rt.decode)


async def test_serial_awaits_p_before_the_headers_answer_and_sets_no_envoy_timer() -> None:
    timeline: list[str] = []
    envoy = ScriptedEnvoy(timeline)
    prefill = ScriptedPrefill()
    task = await run(runtime(prefill, cached=False), envoy)
    await upload(envoy, REQUEST)
    await asyncio.wait_for(prefill.called.wait(), 2)
    assert envoy.sent == []  # no override_message_timeout: Envoy runs no timer here
    prefill.answer(SAME)
    await envoy.until_sent(2)
    assert kinds(envoy) == ["request_headers", "request_body"]
    body = envoy.sent[1].request_body.response.body_mutation.streamed_response.body
    assert orjson.loads(body)["kv_transfer_params"]["remote_engine_id"] == "e1"
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)


async def test_a_body_over_the_limit_is_refused_as_it_arrives() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    task = await run(runtime(prefill, cached=True, limits={"max_body_bytes": 100}), envoy)
    await envoy.inbox.put(streamed_headers())
    await envoy.inbox.put(chunk(b"x" * 60))
    await envoy.inbox.put(chunk(b"x" * 60))  # the rest never comes
    await asyncio.wait_for(task, timeout=2)
    assert kinds(envoy) == ["immediate_response"]
    assert envoy.sent[0].immediate_response.status.code == 413
    assert prefill.calls == []


async def test_a_stalled_upload_ends_with_408() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    task = await run(runtime(prefill, cached=True, timeouts={"upload_idle_s": 0.1}), envoy)
    await envoy.inbox.put(streamed_headers())
    await envoy.inbox.put(chunk(b'{"model": "m", '))
    await asyncio.wait_for(task, timeout=2)
    reply = envoy.sent[-1].immediate_response
    assert reply.status.code == 408 and "stalled" in orjson.loads(reply.body)["error"]["message"]
    assert kinds(envoy) == ["immediate_response"] and prefill.calls == []


async def test_the_client_gone_mid_upload_ends_quietly() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    rt = runtime(prefill, cached=True)
    task = await run(rt, envoy)
    await envoy.inbox.put(streamed_headers())
    await envoy.inbox.put(chunk(b'{"model": "m", '))
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)
    assert envoy.sent == [] and prefill.calls == []
    assert rt.active_streams == 0 and all(e.in_flight == 0 for e in rt.decode)
    # not a 400; the model is not known yet
    counted = {"outcome": "cancelled", "strategy": "none", "reason": "none", "model": "none"}
    assert rt.metrics.registry.get_sample_value("pd_extproc_requests_total", counted) == 1


async def test_a_body_with_trailers_is_refused_before_any_leg() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    task = await run(runtime(prefill, cached=True), envoy)
    await envoy.inbox.put(streamed_headers())
    await envoy.inbox.put(chunk(orjson.dumps(REQUEST)))
    await envoy.inbox.put(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    await asyncio.wait_for(task, timeout=2)
    reply = envoy.sent[-1].immediate_response
    assert reply.status.code == 400 and "trailers" in orjson.loads(reply.body)["error"]["message"]
    assert kinds(envoy) == ["immediate_response"] and prefill.calls == []


@pytest.mark.parametrize("raw", [b"{not json", b""], ids=["not json", "empty"])
async def test_a_bad_body_is_refused_before_any_leg(raw: bytes) -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    task = await run(runtime(prefill, cached=True), envoy)
    await envoy.inbox.put(streamed_headers())
    await envoy.inbox.put(chunk(raw, end=True))
    await asyncio.wait_for(task, timeout=2)
    assert envoy.sent[-1].immediate_response.status.code == 400
    assert prefill.calls == []


async def test_decode_headers_are_held_until_p_fails_then_the_request_ends() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill(PrefillFailed(500, "boom"))
    task = await run(runtime(prefill, cached=True), envoy)
    await upload(envoy, REQUEST | {"stream": True})
    await envoy.inbox.put(response_headers(200))
    await asyncio.wait_for(task, timeout=2)
    assert kinds(envoy) == ["request_headers", "request_body", "immediate_response"]
    assert envoy.sent[-1].immediate_response.status.code == 500


async def test_response_trailers_are_let_through() -> None:
    envoy = ScriptedEnvoy()
    task = await run(runtime(ScriptedPrefill(SAME), cached=True), envoy)
    await upload(envoy, REQUEST)
    await envoy.inbox.put(response_headers(200))
    await envoy.until_sent(3)
    await envoy.inbox.put(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))
    await envoy.until_sent(4)
    assert kinds(envoy)[-1] == "response_trailers"
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)


@pytest.mark.parametrize(
    ("limits", "pieces", "status"),
    [({"max_body_bytes": 8}, [b'{"model": "m"}'], 413), ({}, [b'{"model": 1}', b""], 400)],
)
async def test_a_refused_request_leaves_nothing_for_the_collector(
    limits: dict[str, int], pieces: list[bytes], status: int
) -> None:
    # Its error kept with a traceback would hold the processor in a cycle, and with it the
    # stream (gRPC's call, with what it holds of the body), until a collection ran.
    rt = runtime(ScriptedPrefill(), cached=True, limits=limits)
    envoy = ScriptedEnvoy()
    processor = RequestProcessor(rt.request_deps, EnvoyStream(envoy))  # type: ignore[arg-type]
    gone = weakref.ref(processor)
    await envoy.inbox.put(streamed_headers())
    for piece in pieces[:-1]:
        await envoy.inbox.put(chunk(piece))
    await envoy.inbox.put(chunk(pieces[-1], end=True))
    gc.disable()
    try:
        await asyncio.wait_for(processor.run(), timeout=2)
        assert envoy.sent[-1].immediate_response.status.code == status
        del processor
        assert gone() is None
    finally:
        gc.enable()
    assert rt.request_deps.bodies.in_use == 0


async def test_a_response_chunk_before_p_answers_passes_after_the_held_headers() -> None:
    """A gateway streams D's body through the ext_proc: D's first chunk can come while its
    headers are held for P; it is answered after them, once P answered."""
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()  # holds until told
    task = await run(runtime(prefill, cached=True), envoy)
    await upload(envoy, REQUEST | {"stream": True})
    await envoy.inbox.put(response_headers(200))
    body = ep.HttpBody(body=b"data: {}\n\n", end_of_stream=False)
    await envoy.inbox.put(ep.ProcessingRequest(response_body=body))
    await asyncio.wait_for(prefill.called.wait(), timeout=2)
    await until_true(lambda: envoy.inbox.empty(), "the chunk read while P computes")
    prefill.answer(SAME)
    await envoy.until_sent(5)  # after the held headers' timer extension (no `response`)
    assert kinds(envoy)[2:] == [None, "response_headers", "response_body"]
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)
