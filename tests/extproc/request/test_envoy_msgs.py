"""The ext_proc messages the sidecar sends, read back the way Envoy reads them."""

from __future__ import annotations

import orjson
import pytest
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.errors import ClientError, PrefillUnreachable
from extproc.headers import ENGINE_PRIORITY_HEADER, LOCAL_REPLY_HEADER, SIDECAR_HEADERS
from extproc.protocol.bodies import Spliced
from extproc.request import envoy_msgs

OVERWRITE = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def spliced(raw: bytes) -> Spliced:
    return Spliced((raw,), len(raw))


def set_headers(mutation: ep.HeaderMutation) -> dict[str, str]:
    """The headers a mutation sets; each must replace the client's, never add a second one.
    Only the client's copies of the sidecar's own headers may be removed, and none is both set
    and removed."""
    assert all(h.append_action == OVERWRITE for h in mutation.set_headers)
    removed = set(mutation.remove_headers)
    assert removed <= {*SIDECAR_HEADERS, ENGINE_PRIORITY_HEADER}
    set_ = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert not removed & set(set_)
    return set_


def test_header_map_prefers_raw_value_and_survives_bad_bytes() -> None:
    headers = ep.HttpHeaders(
        headers=core.HeaderMap(
            headers=[
                core.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                core.HeaderValue(key="x-old", value="from value"),
                core.HeaderValue(key="x-both", value="ignored", raw_value=b"raw"),
                core.HeaderValue(key="x-bin", raw_value=b"caf\xe9"),
            ]
        )
    )
    assert envoy_msgs.header_map(headers) == {
        ":path": "/v1/completions",
        "x-old": "from value",
        "x-both": "raw",
        "x-bin": "caf\N{REPLACEMENT CHARACTER}",
    }


@pytest.mark.parametrize(
    ("sent", "status"),
    [
        ([("content-type", b"application/json"), (":status", b"503")], 503),
        ([(":status", b"200"), (":status", b"404")], 200),  # the first, as header_map reads it
        ([(":status", b"ok")], 0),
        ([("content-type", b"text/plain")], 0),
    ],
)
def test_the_status_of_response_headers(sent: list[tuple[str, bytes]], status: int) -> None:
    headers = ep.HttpHeaders(
        headers=core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v) for k, v in sent])
    )
    assert envoy_msgs.status_of(headers) == status


def test_d_gets_our_rank_header_or_none_at_all() -> None:
    """A client's X-data-parallel-rank never reaches D: replaced by ours, or removed."""
    ranked = envoy_msgs.route_mutation(["10.0.0.1:8200"], "rid", 2, rank=1)
    assert set_headers(ranked)["x-data-parallel-rank"] == "1"
    assert list(ranked.remove_headers) == [LOCAL_REPLY_HEADER, ENGINE_PRIORITY_HEADER]
    plain = envoy_msgs.route_mutation(["10.0.0.1:8200"], "rid", 2)
    assert "x-data-parallel-rank" not in set_headers(plain)
    assert list(plain.remove_headers) == [
        "x-data-parallel-rank",
        LOCAL_REPLY_HEADER,
        ENGINE_PRIORITY_HEADER,
    ]
    kept = envoy_msgs.route_mutation(["10.0.0.1:8200"], "rid", 2, engine_priority=True)
    assert ENGINE_PRIORITY_HEADER not in kept.remove_headers
    answer = envoy_msgs.body_answer(spliced(b"{}"), ["10.0.0.1:8200"], "rid", rank=0)
    assert set_headers(answer.request_body.response.header_mutation)["x-data-parallel-rank"] == "0"


def test_continue_answers_the_phase_it_is_for() -> None:
    request = envoy_msgs.continue_request_headers()
    response = envoy_msgs.continue_response_headers()
    assert request.WhichOneof("response") == "request_headers"
    assert response.WhichOneof("response") == "response_headers"
    for message in (request.request_headers, response.response_headers):
        assert message == ep.HeadersResponse()  # no mutation: Envoy goes on unchanged


def test_body_answer_replaces_the_body_and_routes_with_fallbacks() -> None:
    body = '{"prompt":"café ☕"}'.encode()
    answer = envoy_msgs.body_answer(spliced(body), ["10.0.0.1:8200", "10.0.0.2:8200"], "rid-1")
    assert answer.WhichOneof("response") == "request_body"
    common = answer.request_body.response
    assert common.body_mutation.body == body
    assert set_headers(common.header_mutation) == {
        "x-gateway-destination-endpoint": "10.0.0.1:8200,10.0.0.2:8200",
        "x-request-id": "rid-1",
        "content-length": str(len(body)),  # bytes, not characters: 22, not 18
    }
    assert len(body) == 22


def test_body_answer_with_one_destination_has_no_separator() -> None:
    answer = envoy_msgs.body_answer(spliced(b"{}"), ["10.0.0.1:8200"], "r")
    headers = set_headers(answer.request_body.response.header_mutation)
    assert headers["x-gateway-destination-endpoint"] == "10.0.0.1:8200"
    assert headers["content-length"] == "2"


@pytest.mark.parametrize(
    ("seconds", "whole", "nanos"), [(31, 31, 0), (2.5, 2, 500_000_000), (0.25, 0, 250_000_000)]
)
def test_extend_timeout(seconds: float, whole: int, nanos: int) -> None:
    message = envoy_msgs.extend_timeout(seconds)
    assert message.WhichOneof("response") is None  # only the timer override, no phase answer
    timeout = message.override_message_timeout
    assert (timeout.seconds, timeout.nanos) == (whole, nanos)


def test_immediate_error_is_openai_json_with_retry_after() -> None:
    error = PrefillUnreachable(503, "prefill endpoint p is unreachable (UF)", retry_after_s=1)
    message = envoy_msgs.immediate(error)
    reply = message.immediate_response
    assert message.WhichOneof("response") == "immediate_response"
    assert reply.status.code == 503
    assert set_headers(reply.headers) == {"content-type": "application/json", "retry-after": "1"}
    assert orjson.loads(reply.body)["error"]["message"] == error.message
    assert reply.body == error.body
    assert reply.details == "pd_extproc_503"


def test_immediate_client_error_has_no_retry_after() -> None:
    reply = envoy_msgs.immediate(ClientError(400, "bad", param="prompt")).immediate_response
    assert reply.status.code == 400
    assert set_headers(reply.headers) == {"content-type": "application/json"}
    assert orjson.loads(reply.body)["error"]["param"] == "prompt"
    assert reply.details == "pd_extproc_400"


@pytest.mark.parametrize(
    ("details", "reached"),
    [
        (None, True),  # a gateway that sends no attributes: assume D answered
        ("via_upstream", True),
        ("upstream_reset_before_response_started{remote_reset}", True),  # D had it
        ("no_healthy_upstream", False),
        (
            "upstream_reset_before_response_started{remote_connection_failure|"
            "delayed_connect_error:_Connection_refused}",
            False,
        ),
    ],
)
def test_decode_was_reached_reads_envoys_reply_details(details: str | None, reached: bool) -> None:
    message = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
    if details is not None:
        attributes = message.attributes["envoy.filters.http.ext_proc"]
        attributes.fields[envoy_msgs.REPLY_DETAILS].string_value = details
    assert envoy_msgs.decode_was_reached(message) is reached


def test_served_endpoint_from_our_envoys_attribute_or_a_gateways_metadata() -> None:
    message = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
    assert envoy_msgs.served_endpoint(message) is None  # nobody said
    lb = message.metadata_context.filter_metadata["envoy.lb"]
    lb.fields["x-gateway-destination-endpoint-served"].string_value = "10.0.0.2:8000"
    assert envoy_msgs.served_endpoint(message) == "10.0.0.2:8000"  # a GIE gateway
    attributes = message.attributes["envoy.filters.http.ext_proc"]
    attributes.fields[envoy_msgs.UPSTREAM_ADDRESS].string_value = "10.0.0.3:8000"
    assert envoy_msgs.served_endpoint(message) == "10.0.0.3:8000"  # our Envoy's attribute


def _request_headers(*pairs: tuple[str, str]) -> ep.HttpHeaders:
    values = [core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return ep.HttpHeaders(headers=core.HeaderMap(headers=values))


def test_a_repeated_header_is_read_as_its_first_value() -> None:
    headers = _request_headers(("traceparent", "first"), ("x", "1"), ("traceparent", "second"))
    assert envoy_msgs.header_map(headers) == {"traceparent": "first", "x": "1"}


def test_repeated_forwarded_headers_get_one_value_on_both_legs() -> None:
    headers = _request_headers(
        ("traceparent", "a"),
        ("tracestate", "k=1"),
        ("authorization", "Bearer x"),
        ("traceparent", "b"),
        ("tracestate", "m=2"),
        ("other", "1"),
        ("other", "2"),
    )
    names = ["authorization", "traceparent", "tracestate"]
    single = envoy_msgs.repeated_headers(headers, names)
    assert single == {"traceparent": "a", "tracestate": "k=1,m=2"}  # a list header: joined
    assert envoy_msgs.repeated_headers(_request_headers(("traceparent", "a")), names) == {}
    mutation = envoy_msgs.route_mutation(["10.0.0.1:8200"], "r", 2, single=single)
    assert set_headers(mutation)["traceparent"] == "a"
    assert all(
        h.append_action == core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        for h in mutation.set_headers
    )


@pytest.mark.parametrize("body", [b"", b"{}", b"x" * 100_000])
def test_a_streamed_body_under_a_mib_is_one_chunk_ending_the_stream(body: bytes) -> None:
    (answer,) = envoy_msgs.streamed_body_answers(spliced(body))
    assert answer.WhichOneof("response") == "request_body"
    streamed = answer.request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream
    assert ep.ProcessingResponse.FromString(answer.SerializeToString()) == answer


@pytest.mark.parametrize("request_side", [True, False])
@pytest.mark.parametrize(("body", "end"), [(b"", False), (b"", True), (b"data: 1\n\n", False)])
def test_a_passed_through_chunk_goes_back_on_its_side_even_empty(
    request_side: bool, body: bytes, end: bool
) -> None:
    answer = envoy_msgs.body_passthrough(ep.HttpBody(body=body, end_of_stream=end), request_side)
    side = "request_body" if request_side else "response_body"
    assert answer.WhichOneof("response") == side  # an empty chunk's answer is still an answer
    streamed = getattr(answer, side).response.body_mutation.streamed_response
    assert answer.ByteSize() > 0
    assert (streamed.body, streamed.end_of_stream) == (body, end)
    parsed = ep.ProcessingResponse.FromString(answer.SerializeToString())
    assert parsed.WhichOneof("response") == side
