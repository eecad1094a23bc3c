"""The stream processor against a scripted Envoy (no sockets): phase order and failure races."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc import aio

from extproc.errors import PrefillFailed
from extproc.wiring import Runtime
from tests.support.scripted_envoy import (
    D1,
    D2,
    IDENTITY,
    REQUEST,
    P,
    ScriptedEnvoy,
    body,
    headers,
    response_headers,
)
from tests.support.scripted_prefill import ScriptedPrefill, run, runtime

RESTARTED = IDENTITY | {"remote_engine_id": "e2", "remote_request_id": "x"}
SAME = IDENTITY | {"remote_request_id": "x"}


async def send_request(envoy: ScriptedEnvoy, doc: dict[str, Any]) -> None:
    """Envoy's request phases: the headers, then the whole body."""
    await envoy.inbox.put(headers())
    await envoy.inbox.put(body(doc))


async def dispatched(envoy: ScriptedEnvoy, doc: dict[str, Any]) -> None:
    """Send the request and wait until the processor has answered its body."""
    await send_request(envoy, doc)
    await envoy.until_sent(2)


async def test_prefill_failing_while_the_answer_is_written_still_ends_the_request() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill(PrefillFailed(500, "boom"))  # fails at its first step
    rt = runtime(prefill, cached=True)
    task = await run(rt, envoy)
    await send_request(envoy, REQUEST)
    await asyncio.wait_for(task, timeout=2)  # Envoy sends nothing more: no hang
    kinds = [m.WhichOneof("response") for m in envoy.sent]
    assert kinds == ["request_headers", "request_body", "immediate_response"]
    assert envoy.sent[-1].immediate_response.status.code == 500
    assert rt.identities.get(P) is None  # the next request learns P's identity again


async def test_parallel_answer_carries_identity_routing_and_content_length() -> None:
    envoy = ScriptedEnvoy()
    rt = runtime(ScriptedPrefill(SAME, compute_s=0.05), cached=True)
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST | {"kv_transfer_params": {"remote_host": "evil"}})
    answer = envoy.sent[1].request_body.response
    new_body = answer.body_mutation.body
    set_headers = {
        h.header.key: h.header.raw_value.decode() for h in answer.header_mutation.set_headers
    }
    assert set_headers["x-gateway-destination-endpoint"] == D1
    assert int(set_headers["content-length"]) == len(new_body)
    params = orjson.loads(new_body)["kv_transfer_params"]
    assert (
        params["remote_engine_id"] == "e1"
        and params["remote_request_id"] == set_headers["x-request-id"]
    )
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)
    assert rt.active_streams == 0 and all(e.in_flight == 0 for e in rt.decode)


@pytest.mark.parametrize(
    ("message", "status"),
    [(headers("/v1/embeddings"), 404), (headers(end=True), 400)],
    ids=["unknown path", "no body"],
)
async def test_refusals_at_the_headers_phase(message: ep.ProcessingRequest, status: int) -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    task = await run(runtime(prefill, cached=True), envoy)
    await envoy.inbox.put(message)
    await asyncio.wait_for(task, timeout=2)
    assert envoy.sent[-1].immediate_response.status.code == status
    assert prefill.calls == []


async def test_restart_seen_in_the_wake_up_of_decode_headers_gives_503_not_200() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    task = await run(runtime(prefill, cached=True), envoy)
    await dispatched(envoy, REQUEST | {"stream": True})
    # D's headers and P's answer (a new engine id) complete before the processor wakes up
    envoy.inbox.put_nowait(response_headers(200))
    prefill.answer(RESTARTED)
    await asyncio.wait_for(task, timeout=2)
    kinds = [m.WhichOneof("response") for m in envoy.sent]
    assert kinds == ["request_headers", "request_body", "immediate_response"]
    reply = envoy.sent[-1].immediate_response
    assert reply.status.code == 503
    assert {h.header.key: h.header.raw_value for h in reply.headers.set_headers}[
        "retry-after"
    ] == b"1"
    assert "restarted" in orjson.loads(reply.body)["error"]["message"]


@pytest.mark.parametrize(
    ("params", "answer"),
    [(SAME, "response_headers"), (RESTARTED, "immediate_response")],
    ids=["same engine", "restarted"],
)
async def test_decode_headers_before_prefill_answers_are_held_until_it_settles(
    params: dict[str, Any], answer: str
) -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    rt = runtime(prefill, cached=True)
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST | {"stream": True})
    await envoy.inbox.put(response_headers(200))  # a streaming D answers at once
    await envoy.until_sent(3)
    held = envoy.sent[2]
    assert held.WhichOneof("response") is None and held.override_message_timeout.seconds > 1
    prefill.answer(params)
    await envoy.until_sent(4)
    assert envoy.sent[3].WhichOneof("response") == answer
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)
    assert rt.active_streams == 0 and all(e.in_flight == 0 for e in rt.decode)


async def test_serial_decode_body_over_envoys_buffer_is_refused_before_it_leaves() -> None:
    envoy = ScriptedEnvoy()
    blocks = {"remote_block_ids": [list(range(100_000, 120_000))]}  # ~140 kB of block ids
    prefill = ScriptedPrefill(SAME | blocks)
    rt = runtime(prefill, cached=False, limits={"max_body_bytes": 1024})
    task = await run(rt, envoy)  # no identity cached: serial, D's body is built after P
    await send_request(envoy, REQUEST)
    await asyncio.wait_for(task, timeout=2)
    kinds = [m.WhichOneof("response") for m in envoy.sent]
    assert kinds == ["request_headers", None, "immediate_response"]  # None: timer extended
    reply = envoy.sent[-1].immediate_response
    assert reply.status.code == 413
    assert "over the proxy's buffer" in orjson.loads(reply.body)["error"]["message"]


async def test_decode_refusal_passes_at_once_and_cancels_the_prefill_leg() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()  # P never answers unless cancelled
    task = await run(runtime(prefill, cached=True), envoy)
    await dispatched(envoy, REQUEST)
    await envoy.inbox.put(response_headers(400))
    await envoy.until_sent(3)
    assert envoy.sent[2].WhichOneof("response") == "response_headers"  # not held for P
    await asyncio.wait_for(prefill.cancelled.wait(), 2)  # nor reset later by P's outcome
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)
    assert len(envoy.sent) == 3


async def test_parallel_prefill_leaves_before_the_decode_answer_is_written() -> None:
    timeline: list[str] = []
    envoy = ScriptedEnvoy(timeline)
    task = await run(
        runtime(ScriptedPrefill(SAME, compute_s=0.05, timeline=timeline), cached=True), envoy
    )
    await dispatched(envoy, REQUEST)
    # P's request is on its way while Envoy is still receiving D's body: never after it
    assert timeline == ["request_headers", "P leg created", "P leg sent", "request_body"]
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)


async def test_answer_names_a_fallback_decode_for_envoys_connect_retry() -> None:
    envoy = ScriptedEnvoy()
    rt = runtime(ScriptedPrefill(SAME, compute_s=0.05), cached=True, decodes=(D1, D2))
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST)
    answer = envoy.sent[1].request_body.response
    set_headers = {
        h.header.key: h.header.raw_value.decode() for h in answer.header_mutation.set_headers
    }
    assert set_headers["x-gateway-destination-endpoint"] == f"{D1},{D2}"
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)


async def test_decode_5xx_drops_the_identity_it_was_given() -> None:
    envoy = ScriptedEnvoy()
    rt = runtime(ScriptedPrefill(SAME, compute_s=0.05), cached=True)
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST)
    await envoy.inbox.put(response_headers(503))
    await envoy.until_kind("response_headers")  # D's 503 goes on to the client
    assert rt.identities.get(P) is None  # P answered as usual, yet D failed: learn it again
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)


def outcomes(rt: Runtime) -> dict[tuple[str, str, str], float]:
    """pd_extproc_requests as {(outcome, strategy, reason): count}."""
    return {
        (s.labels["outcome"], s.labels["strategy"], s.labels["reason"]): s.value
        for metric in rt.metrics.registry.collect()
        if metric.name == "pd_extproc_requests"
        for s in metric.samples
        if s.name.endswith("_total")
    }


async def test_decode_failing_before_a_restarted_prefill_answers_gives_503() -> None:
    """D fails its handshake at once; P, answered within the grace, reveals a new engine."""
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    rt = runtime(prefill, cached=True)
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST)
    await envoy.inbox.put(response_headers(500))
    await envoy.until_sent(3)  # the message timer extended for the grace
    assert envoy.sent[2].override_message_timeout.seconds >= 1
    prefill.answer(RESTARTED)
    await asyncio.wait_for(task, timeout=2)
    reply = envoy.sent[-1].immediate_response
    assert reply.status.code == 503 and "restarted" in orjson.loads(reply.body)["error"]["message"]
    assert outcomes(rt) == {("identity_changed", "parallel", "cache_hit"): 1.0}
    assert rt.identities.get(P) is not None  # the new engine, learnt from P's answer


async def test_decode_failing_with_prefill_silent_past_the_grace_cancels_it() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()  # P never answers unless cancelled
    rt = runtime(prefill, cached=True, timeouts={"decode_error_grace_s": 0.05})
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST)
    await envoy.inbox.put(response_headers(502))
    await envoy.until_kind("response_headers")  # D's own error goes on to the client
    await asyncio.wait_for(prefill.cancelled.wait(), 2)
    assert rt.identities.get(P) is None  # the identity D was given failed it: learn again
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)
    assert outcomes(rt) == {("decode_5xx", "parallel", "cache_hit"): 1.0}


async def test_stream_ending_while_prefill_computes_cancels_the_leg() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    rt = runtime(prefill, cached=True)
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST)
    await envoy.inbox.put(aio.EOF)  # the client went away before D answered
    await asyncio.wait_for(task, timeout=2)
    await asyncio.wait_for(prefill.cancelled.wait(), 2)
    assert outcomes(rt) == {("cancelled", "parallel", "cache_hit"): 1.0}
    assert all(e.in_flight == 0 for e in [*rt.decode, *rt.prefill])


async def test_serial_client_gone_while_prefill_computes_cancels_it_and_sends_no_decode() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    rt = runtime(prefill, cached=False)
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST)  # the timer extended while P computes
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, timeout=2)
    await asyncio.wait_for(prefill.cancelled.wait(), 2)
    assert [m.WhichOneof("response") for m in envoy.sent] == ["request_headers", None]
    assert outcomes(rt) == {("cancelled", "serial", "cache_miss"): 1.0}


async def test_prefill_silent_while_decode_headers_are_held_gives_504_and_cancels_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()  # P never answers unless cancelled
    rt = runtime(prefill, cached=True, timeouts={"prefill_s": 0.3})
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST | {"stream": True})
    await envoy.inbox.put(response_headers(200))
    await asyncio.wait_for(task, timeout=3)
    kinds = [m.WhichOneof("response") for m in envoy.sent]
    assert kinds == ["request_headers", "request_body", None, "immediate_response"]
    assert envoy.sent[2].override_message_timeout.ToMilliseconds() == 1300  # prefill_s + 1
    reply = envoy.sent[-1].immediate_response
    assert reply.status.code == 504
    assert orjson.loads(reply.body)["error"]["message"] == (
        "the prefill engine did not answer within 0.3 s"  # its address stays in the log
    )
    assert f"failed: 504 the prefill engine did not answer within 0.3 s (prefill {P})" in (
        caplog.text
    )
    assert prefill.cancelled.is_set()


async def test_stream_ending_while_decode_headers_are_held_cancels_the_prefill_leg() -> None:
    envoy = ScriptedEnvoy()
    prefill = ScriptedPrefill()
    rt = runtime(prefill, cached=True)
    task = await run(rt, envoy)
    await dispatched(envoy, REQUEST | {"stream": True})
    await envoy.inbox.put(response_headers(200))
    await envoy.until_sent(3)  # the hold: Envoy's timer extended, nothing answered
    await envoy.inbox.put(aio.EOF)  # the client went away
    await asyncio.wait_for(task, timeout=2)
    await asyncio.wait_for(prefill.cancelled.wait(), 2)
    assert [m.WhichOneof("response") for m in envoy.sent] == [
        "request_headers",
        "request_body",
        None,
    ]
    assert rt.active_streams == 0 and all(e.in_flight == 0 for e in rt.decode)
    assert outcomes(rt) == {("cancelled", "parallel", "cache_hit"): 1.0}  # D's 200 never left
