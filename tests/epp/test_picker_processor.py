"""One request through the processor in endpoint-picker mode, against a scripted gateway Envoy
(streamed bodies both ways, metadata in and out) and a P leg the test controls."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from google.protobuf import struct_pb2

from extproc.protocol.identity import PrefillIdentity, identity_from_params
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
    strings,
)
from tests.support.scripted_envoy import (
    IDENTITY,
    P_ANSWER,
    WAIT_S,
    error,
    headers,
    response_headers,
)


async def test_destination_goes_out_as_header_and_metadata_with_fallbacks() -> None:
    r = PickerRequest(endpoint_picker={"fallbacks": 2})
    r.rt.identities.learn(P1, _identity())
    await r.start()
    sent = await r.envoy.until_sent(2)
    header, metadata = destination(sent[0])
    assert header == metadata == f"{D1},{D2},{D3}"
    await r.end()


async def test_both_legs_are_picked_inside_the_subset_hint() -> None:
    r = PickerRequest()
    r.rt.identities.learn(P2, _identity())
    await r.start(strings(f"{D3},127.0.0.1:9999", P2))  # a list, one entry of two
    sent = await r.envoy.until_sent(2)
    header, metadata = destination(sent[0])
    assert header == metadata == D3  # the subset leaves no fallback
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    assert r.prefill.calls[0].endpoint == P2
    await r.end()


async def test_a_subset_with_no_decode_that_can_serve_gets_503() -> None:
    r = PickerRequest()
    r.rt.decode.set_healthy(D3, False)
    await r.start(struct_pb2.Value(string_value=f"{P1}, {D3}"))  # D3 is down
    [answer] = await r.envoy.until_sent(1)
    status, message, retry = error(answer)
    assert (status, retry) == (503, "1")
    assert "subset hint" in message
    assert r.prefill.calls == []
    await r.end()


async def test_d_body_arriving_while_its_headers_are_held_follows_them() -> None:
    """The gateway streams D's answer through the picker: a body chunk can come while D's
    headers wait for P; it is answered after the headers, not taken for the stream's end."""
    r = PickerRequest()
    r.rt.identities.learn(P1, _identity())
    await r.start()
    await r.envoy.until_sent(2)  # headers (destination), then the body
    await r.send(response_headers(200), response_chunk(b"data: 1\n\n", False))
    await until(lambda: r.envoy.inbox.empty(), "the processor reading both")
    assert [m.WhichOneof("response") for m in r.envoy.sent[2:]] == [None]  # "wait longer"
    r.prefill.answer(P_ANSWER)
    sent = await r.envoy.until_sent(5)
    assert [m.WhichOneof("response") for m in sent[3:]] == ["response_headers", "response_body"]
    passed = sent[4].response_body.response.body_mutation.streamed_response
    assert (passed.body, passed.end_of_stream) == (b"data: 1\n\n", False)
    await r.send(response_chunk(b"", True))
    sent = await r.envoy.until_sent(6)
    assert sent[5].response_body.response.body_mutation.streamed_response.end_of_stream
    await r.end()


async def until(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _identity() -> PrefillIdentity:
    return identity_from_params(IDENTITY)


async def test_an_engine_endpoint_goes_to_a_decode_in_the_subset_as_it_is() -> None:
    r = PickerRequest()
    opening = headers(path="/tokenize")
    opening.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
        "x-gateway-destination-endpoint-subset"
    ].string_value = D2
    await r.send(opening, chunk(b'{"prompt":', False), chunk(b'"hi"}', True))
    sent = await r.envoy.until_sent(3)
    header, metadata = destination(sent[0])
    assert header == metadata == D2
    echoed = [m.request_body.response.body_mutation.streamed_response for m in sent[1:]]
    assert [(e.body, e.end_of_stream) for e in echoed] == [(b'{"prompt":', False), (b'"hi"}', True)]
    await r.send(response_headers(200), response_chunk(b'{"tokens":[1]}', True))
    sent = await r.envoy.until_sent(5)
    assert [m.WhichOneof("response") for m in sent[3:]] == ["response_headers", "response_body"]
    await r.end()
    assert r.prefill.calls == []
    labels = {"outcome": "ok", "strategy": "decode_only", "reason": "passthrough", "model": "none"}
    assert r.rt.metrics.registry.get_sample_value("pd_extproc_requests_total", labels) == 1
