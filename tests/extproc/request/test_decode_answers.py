"""Envoy's answers that send D its body: buffered (one answer) or streamed (the headers, then
the body in chunks of a MiB), each carrying D's rank, the client's repeated headers made
single, the client's engine priority as the operator allows, and, for the endpoint picker,
the destination as metadata."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.config import parse_config
from extproc.headers import DESTINATION_HEADER, ENGINE_PRIORITY_HEADER, RANK_HEADER
from extproc.protocol.bodies import Spliced
from extproc.request.plan import DecodeOnlyPlan
from extproc.request.strategies import Exchange, decode_answers
from extproc.request.stream import EnvoyStream
from extproc.tracing import RequestTrace
from tests.support.scripted_envoy import ScriptedEnvoy

D1, D2 = "127.0.0.1:8201", "127.0.0.1:8202"
RAW = b'{"model":"m","prompt":"hi"}'
BODY = Spliced((RAW,), len(RAW))


def exchange(streamed: bool, kept: bool = False, **fields: Any) -> Exchange:
    config = parse_config(
        {
            "prefill": {"endpoints": ["127.0.0.1:8101"]},
            "decode": {"endpoints": [D1, D2]},
            "dispatch": {"client_engine_priority": kept},
        }
    )
    stream = EnvoyStream(ScriptedEnvoy())  # type: ignore[arg-type]
    return Exchange(stream, RequestTrace(), "/v1/completions", {}, "", config, streamed, **fields)


def plan(rank: int | None) -> DecodeOnlyPlan:
    return DecodeOnlyPlan("r1", [D1, D2], BODY, "decision", None, rank)


def headers_of(answers: tuple[Any, ...], streamed: bool) -> tuple[dict[str, str], list[str]]:
    side = answers[0].request_headers if streamed else answers[0].request_body
    mutation = side.response.header_mutation
    values = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    return values, list(mutation.remove_headers)


@pytest.mark.parametrize("streamed", [False, True], ids=["buffered", "streamed"])
def test_d_gets_its_rank_and_the_single_headers(streamed: bool) -> None:
    sent_to = exchange(streamed, single_headers={"x-tenant": "a"})
    answers = tuple(decode_answers(plan(2), BODY, sent_to))
    values, removed = headers_of(answers, streamed)
    assert values[DESTINATION_HEADER] == f"{D1},{D2}" and values["x-request-id"] == "r1"
    assert (values[RANK_HEADER], values["x-tenant"]) == ("2", "a")
    assert values["content-length"] == str(len(RAW))
    assert RANK_HEADER not in removed and ENGINE_PRIORITY_HEADER in removed
    sent = answers[-1].request_body.response.body_mutation
    assert (sent.streamed_response.body if streamed else sent.body) == RAW
    assert len(answers) == (2 if streamed else 1)


@pytest.mark.parametrize("streamed", [False, True], ids=["buffered", "streamed"])
def test_a_d_without_ranks_has_the_clients_rank_removed_and_its_priority_kept_if_allowed(
    streamed: bool,
) -> None:
    answers = tuple(decode_answers(plan(None), BODY, exchange(streamed, kept=True)))
    values, removed = headers_of(answers, streamed)
    assert RANK_HEADER not in values and RANK_HEADER in removed
    assert ENGINE_PRIORITY_HEADER not in removed and "x-tenant" not in values


@pytest.mark.parametrize("streamed", [False, True], ids=["buffered", "streamed"])
def test_the_endpoint_pickers_answer_carries_the_destination_as_metadata(streamed: bool) -> None:
    picked = exchange(streamed, destination_namespace="my.lb")
    answers = tuple(decode_answers(plan(None), BODY, picked))
    fields = answers[0].dynamic_metadata.fields["my.lb"].struct_value.fields
    assert fields[DESTINATION_HEADER].string_value == f"{D1},{D2}"
    assert all(not a.HasField("dynamic_metadata") for a in answers[1:])
    plain = tuple(decode_answers(plan(None), BODY, exchange(streamed)))
    assert not plain[0].HasField("dynamic_metadata")


def test_a_streamed_body_goes_out_in_chunks_of_a_mib_the_last_ending_the_stream() -> None:
    head, prompt = b'{"prompt":"', memoryview(b"x" * (5 << 19))  # two and a half MiB
    body = Spliced((head, prompt, b'"}'), len(head) + len(prompt) + 2)
    answers = tuple(decode_answers(plan(None), body, exchange(True)))
    chunks = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert [len(c.body) for c in chunks] == [1 << 20, 1 << 20, len(body) - (2 << 20)]
    assert b"".join(c.body for c in chunks) == bytes(body)
    assert [c.end_of_stream for c in chunks] == [False, False, True]


@pytest.mark.parametrize("size", [1 << 20, (1 << 20) + 1, 2 << 20], ids=["1MiB", "1MiB+1", "2MiB"])
def test_only_the_last_chunk_ends_the_stream_whatever_the_size(size: int) -> None:
    head = b'{"p":"'
    body = Spliced((head, b"x" * (size - len(head) - 2), b'"}'), size)
    answers = tuple(decode_answers(plan(None), body, exchange(True)))[1:]
    chunks = [a.request_body.response.body_mutation.streamed_response for a in answers]
    assert len(chunks) == -(-size // (1 << 20))
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert b"".join(c.body for c in chunks) == bytes(body)
