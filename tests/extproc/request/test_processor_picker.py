"""The processor in endpoint-picker mode: an engine's own endpoint passed through to a decode
(its destination, bodies, trailers, admission and counts), and what the picker changes in a
P/D request (the subset hint, fallbacks, the destination's namespace); the client's trace
context in either mode."""

from __future__ import annotations

import asyncio

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc.engines.kv_compat import Mismatch
from extproc.protocol.identity import identity_from_params
from tests.support.picker_request import (
    D1,
    D2,
    D3,
    P1,
    P2,
    PickerRequest,
    chunk,
    destination,
    response_chunk,
    with_hint,
)
from tests.support.scripted_envoy import IDENTITY, WAIT_S, error, headers, response_headers

TRAILERS = ep.ProcessingRequest(request_trailers=ep.HttpTrailers())


def tokenize(subset: str | None = None, **header_values: str) -> ep.ProcessingRequest:
    opening = headers(path="/tokenize", **header_values)
    if subset is not None:
        with_hint(opening, struct_pb2.Value(string_value=subset))
    return opening


async def test_an_engine_endpoint_passes_to_a_decode_with_its_bodies_and_trailers() -> None:
    r = PickerRequest()
    await r.send(tokenize(D2), chunk(b'{"prompt":', False), chunk(b'"hi"}', True), TRAILERS)
    sent = await r.envoy.until_sent(4)
    assert destination(sent[0]) == (D2, D2)
    assert [m.WhichOneof("response") for m in sent[1:4]] == [
        "request_body",
        "request_body",
        "request_trailers",
    ]
    echoed = [m.request_body.response.body_mutation.streamed_response for m in sent[1:3]]
    assert [(e.body, e.end_of_stream) for e in echoed] == [(b'{"prompt":', False), (b'"hi"}', True)]
    assert [s.in_flight for s in r.rt.decode] == [0, 1, 0]  # counted at D2 while it runs
    await r.send(response_headers(200), response_chunk(b'{"tokens":[1]}', True))
    sent = await r.envoy.until_sent(6)
    assert [m.WhichOneof("response") for m in sent[4:]] == ["response_headers", "response_body"]
    await r.end()
    assert [s.in_flight for s in r.rt.decode] == [0, 0, 0] and r.prefill.calls == []
    assert r.requests(outcome="ok", strategy="decode_only", reason="passthrough", model="none") == 1


async def test_a_passed_through_request_lists_the_fallbacks_in_the_pickers_namespace() -> None:
    r = PickerRequest(endpoint_picker={"fallbacks": 2, "destination_namespace": "my.lb"})
    await r.send(tokenize())
    [answer] = await r.envoy.until_sent(1)
    assert destination(answer, "my.lb") == (f"{D1},{D2},{D3}",) * 2
    await r.end()


async def test_a_passed_through_request_is_admitted_at_its_priority() -> None:
    r = PickerRequest(admission={"enabled": True, "priority_header": "x-priority"})
    await r.send(tokenize(x_priority="high"))  # not an integer: counted, served at priority 0
    await r.envoy.until_sent(1)
    await r.end()
    assert r.rt.metrics.invalid_priorities._value.get() == 1


async def test_a_passed_through_request_with_no_decode_is_counted_as_passed_through() -> None:
    r = PickerRequest()
    for d in (D1, D2, D3):
        r.rt.decode.set_healthy(d, False)
    await r.send(tokenize())
    [answer] = await r.envoy.until_sent(1)
    assert error(answer)[0] == 503
    await r.end()
    assert (
        r.requests(
            outcome="no_healthy_decode", strategy="decode_only", reason="passthrough", model="none"
        )
        == 1
    )


async def test_a_silent_gateway_does_not_hold_a_passed_through_request() -> None:
    r = PickerRequest(timeouts={"request_s": 0.1})
    await r.send(tokenize())
    await r.envoy.until_sent(1)
    await asyncio.wait_for(r.task, WAIT_S)  # no body, no answer, no end of stream
    assert [s.in_flight for s in r.rt.decode] == [0, 0, 0]


async def test_without_the_picker_an_engine_endpoint_is_not_served() -> None:
    r = PickerRequest(picker_mode=False)
    await r.send(tokenize(D2))
    [answer] = await r.envoy.until_sent(1)
    status, message, _ = error(answer)
    assert status == 404 and "/tokenize is not served here" in message
    await r.end()


async def test_a_pd_request_in_picker_mode_keeps_to_the_subset_and_the_pickers_namespace() -> None:
    r = PickerRequest(endpoint_picker={"fallbacks": 2, "destination_namespace": "my.lb"})
    r.rt.identities.learn(P2, identity_from_params(IDENTITY))
    subset = struct_pb2.ListValue(values=[struct_pb2.Value(string_value=v) for v in (D2, D3, P2)])
    await r.start(struct_pb2.Value(list_value=subset))
    sent = await r.envoy.until_sent(2)
    assert destination(sent[0], "my.lb") == (f"{D2},{D3}",) * 2  # the subset bounds fallbacks
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    assert r.prefill.calls[0].endpoint == P2
    await r.end()


async def test_a_pd_request_in_picker_mode_lists_its_fallbacks() -> None:
    r = PickerRequest(endpoint_picker={"fallbacks": 2})
    r.rt.identities.learn(P1, identity_from_params(IDENTITY))
    r.rt.identities.learn(P2, identity_from_params(IDENTITY))
    await r.start()
    sent = await r.envoy.until_sent(2)
    assert destination(sent[0]) == (f"{D1},{D2},{D3}",) * 2
    await r.end()


async def test_the_clients_trace_context_is_joined_in_either_mode() -> None:
    for picker_mode in (True, False):
        r = PickerRequest(picker_mode=picker_mode)
        await r.send(tokenize(traceparent="00-ab-cd-01", tracestate="k=v"))  # a 404 without
        await r.envoy.until_sent(1)
        await r.end()
        assert r.trace.joined == [("00-ab-cd-01", "k=v")]


# ---- which D served: its count, and a P/D pair known not to exchange KV ---------------------


def served_by(status: int, served: str | None) -> ep.ProcessingRequest:
    answer = response_headers(status)
    if served is not None:
        lb = answer.metadata_context.filter_metadata["envoy.lb"]
        lb.fields["x-gateway-destination-endpoint-served"].string_value = served
    return answer


async def test_the_count_moves_to_the_fallback_that_served_a_passed_through_request() -> None:
    r = PickerRequest(endpoint_picker={"fallbacks": 2})
    await r.send(tokenize(D2))
    await r.envoy.until_sent(1)
    assert [s.in_flight for s in r.rt.decode] == [0, 1, 0]
    await r.send(served_by(200, D3), response_chunk(b"{}", True))
    sent = await r.envoy.until_sent(3)
    passed = sent[2].response_body.response.body_mutation.streamed_response
    assert (passed.body, passed.end_of_stream) == (b"{}", True)
    assert [s.in_flight for s in r.rt.decode] == [0, 0, 1]
    await r.end()


def mismatch_request(decode: str) -> PickerRequest:
    r = PickerRequest(endpoint_picker={"fallbacks": 2})
    for p in (P1, P2):
        r.rt.identities.learn(p, identity_from_params(IDENTITY))
        r.rt.kv_compat.failed(Mismatch(p, decode, "push", "HTTP 500: transfer failed"))
    return r


@pytest.mark.parametrize(
    ("status", "served", "expected"),
    [
        (500, D2, 502),  # the fallback that served is the pair known to fail
        (503, None, None),  # Envoy did not say: the choice, D1, answered
        (499, D2, None),  # not D failing
    ],
    ids=["served-fallback", "choice", "below-500"],
)
async def test_d_failing_a_pair_known_not_to_exchange_kv_tells_the_client_why(
    status: int, served: str | None, expected: int | None
) -> None:
    r = mismatch_request(D2)
    await r.start()
    await r.envoy.until_sent(2)
    await r.send(served_by(status, served))
    [answer] = (await r.envoy.until_sent(3))[2:]
    await r.end()
    if expected is None:
        assert answer.WhichOneof("response") != "immediate_response"
        return
    code, message, _ = error(answer)
    assert code == expected and "their KV connectors do not match" in message


async def test_a_known_mismatch_at_the_choice_is_told_when_envoy_does_not_say_who_served() -> None:
    r = mismatch_request(D1)
    await r.start()
    await r.envoy.until_sent(2)
    await r.send(served_by(500, None))
    [answer] = (await r.envoy.until_sent(3))[2:]
    await r.end()
    code, message, _ = error(answer)
    assert code == 502 and "their KV connectors do not match" in message
