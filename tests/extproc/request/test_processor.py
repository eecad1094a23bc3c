"""One request through the processor, against a scripted Envoy and a P leg the test controls.

Every message the sidecar writes to Envoy is checked, with what P was sent, what the cache
and the pools hold afterwards, and what the metrics and the trace report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc import aio

from extproc.errors import PrefillBusy, PrefillFailed, PrefillTimeout, PrefillUnreachable
from extproc.headers import RANK_HEADER
from extproc.policies import PickRequest
from extproc.protocol.identity import identity_from_params
from extproc.request.envoy_msgs import REPLY_DETAILS
from extproc.request.processor import RequestProcessor
from extproc.request.stream import EnvoyStream
from extproc.scheduling.pool import EndpointState
from extproc.tracing import RequestTrace
from extproc.wiring import Runtime
from tests.support.polling import until_true
from tests.support.routing import fixed_routing_config
from tests.support.scripted_envoy import (
    D1,
    D2,
    IDENTITY,
    P2,
    P_ANSWER,
    WAIT_S,
    P,
    ScriptedEnvoy,
    body,
    error,
    headers,
    labels,
    response_headers,
    routed,
)
from tests.support.scripted_envoy import (
    STREAMED_REQUEST as REQUEST,
)
from tests.support.scripted_prefill import ScriptedPrefill


class Trace(RequestTrace):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def prefill_started(self) -> None:
        self.events.append(("prefill_started", None))

    def prefill_finished(self, outcome: str) -> None:
        self.events.append(("prefill_finished", outcome))

    def decode_started(self) -> None:
        self.events.append(("decode_started", None))

    def decode_answered(self, status: int) -> None:
        self.events.append(("decode_answered", status))

    def finish(self, fields: dict[str, Any]) -> None:
        self.events.append(("finish", fields))


class Request:
    """One request's run: the runtime, the scripted Envoy, the P leg and the trace."""

    def __init__(
        self,
        cached: bool = False,
        p_leg: ScriptedPrefill | None = None,
        runtime: Runtime | None = None,
        **config: Any,
    ) -> None:
        config.setdefault("prefill", {"endpoints": [P]})
        config.setdefault("decode", {"endpoints": [D1, D2]})
        self.rt = runtime or Runtime(fixed_routing_config(config), "unix:/nonexistent")
        self.prefill = p_leg or ScriptedPrefill()
        self.trace = Trace()
        deps = self.rt.request_deps
        legs = dataclasses.replace(deps.legs, prefill_client=self.prefill)
        self.rt.request_deps = dataclasses.replace(deps, legs=legs, new_trace=lambda: self.trace)
        if cached:
            self.rt.identities.learn(P, identity_from_params(IDENTITY))
        self.envoy = ScriptedEnvoy()
        stream = EnvoyStream(self.envoy)  # type: ignore[arg-type]
        self.processor = RequestProcessor(self.rt.request_deps, stream)
        self.task = asyncio.create_task(self.processor.run())

    async def send(self, *messages: Any) -> None:
        for message in messages:
            await self.envoy.inbox.put(message)

    async def start(self, doc: dict[str, Any] = REQUEST, **header_values: str) -> None:
        await self.send(headers(**header_values), body(doc))

    async def end(self) -> None:
        await self.send(aio.EOF)
        await asyncio.wait_for(self.task, WAIT_S)

    async def p_fails_after_both_legs_left(self) -> list[ep.ProcessingResponse]:
        """Start; once D's leg is out too, P's leg fails with 502; wait for the request to end.
        What Envoy was sent."""
        await self.start()
        await self.envoy.until_sent(2)
        self.prefill.fail(PrefillFailed(502, "prefill endpoint p answered 500"))
        sent = await self.envoy.until_sent(3)
        await asyncio.wait_for(self.task, WAIT_S)
        return sent

    def sample(self, name: str, **labels: str) -> float | None:
        return self.rt.metrics.registry.get_sample_value(name, labels)

    def outcome(self, outcome: str, strategy: str, reason: str) -> float | None:
        """pd_extproc_requests_total for these labels, whatever the model."""
        labels = {"outcome": outcome, "strategy": strategy, "reason": reason}
        found = [
            sample.value
            for metric in self.rt.metrics.registry.collect()
            if metric.name == "pd_extproc_requests"
            for sample in metric.samples
            if sample.name.endswith("_total") and labels.items() <= sample.labels.items()
        ]
        return sum(found) if found else None

    def idle(self) -> bool:
        return all(s.in_flight == 0 for s in [*self.rt.prefill, *self.rt.decode])


# ---- serial -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        PrefillUnreachable(503, "unreachable", retry_after_s=1),
        PrefillBusy(502, "prefill endpoint answered 503"),
    ],
    ids=["unreachable", "busy"],
)
async def test_serial_retries_a_failed_p_once_on_the_fallback_within_the_prefill_timeout(
    error: Exception,
) -> None:
    prefill = ScriptedPrefill(error)  # the first leg fails; the test answers the second
    r = Request(
        p_leg=prefill,
        prefill={"endpoints": [P, P2]},
        dispatch={"mode": "serial_push"},
        timeouts={"prefill_s": 10},
    )
    await r.start()
    first_leg, second_leg = await prefill.until_called(2)
    first, second = first_leg.endpoint, second_leg.endpoint
    assert {first, second} == {P, P2}
    assert first_leg.timeout_s == 10 and 9 < second_leg.timeout_s < 10
    prefill.answer(P_ANSWER)
    sent = await r.envoy.until_sent(3)
    assert routed(sent[2])[0]["kv_transfer_params"]["remote_engine_id"] == "e1"
    reason = "unreachable" if isinstance(error, PrefillUnreachable) else "busy"
    assert r.sample("pd_extproc_prefill_retries_total", reason=reason) == 1
    healthy = {s.address: s.healthy for s in r.rt.prefill}
    assert healthy[first] is not isinstance(error, PrefillUnreachable) and healthy[second]
    await r.send(response_headers(200))
    await r.envoy.until_sent(4)
    await r.end()
    assert r.outcome("ok", "serial", "serial_only") == 1


async def test_a_retry_is_counted_at_its_fallback_and_logged_with_both_ps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill = ScriptedPrefill(PrefillBusy(502, "prefill endpoint answered 503"))
    r = Request(
        p_leg=prefill,
        prefill={"endpoints": [P, P2]},
        dispatch={"mode": "serial_push"},
        timeouts={"prefill_s": 0.8},  # under a second left: still time for the retry
    )
    with caplog.at_level(logging.INFO, logger="extproc"):
        await r.start()
        first_leg, second_leg = await prefill.until_called(2)
    first, second = first_leg.endpoint, second_leg.endpoint
    in_flight = {s.address: s.in_flight for s in r.rt.prefill}
    assert (in_flight[first], in_flight[second]) == (0, 1)
    [line] = [m for m in caplog.messages if "retrying" in m]
    expected = rf"request [0-9a-f-]{{36}}: prefill {first} busy, retrying on {second}"
    assert re.fullmatch(expected, line)
    prefill.answer(P_ANSWER)
    await r.envoy.until_sent(3)
    await r.send(response_headers(200))
    await r.envoy.until_sent(4)
    await r.end()
    assert r.idle() and r.outcome("ok", "serial", "serial_only") == 1


async def test_serial_dispatch_waits_for_p_and_forwards_its_params() -> None:
    r = Request(timeouts={"prefill_s": 12.5})
    await r.start(
        REQUEST | {"kv_transfer_params": {"remote_host": "evil"}},
        x_request_id="c-1",
        authorization="Bearer k",
        x_other="no",
    )
    sent = await r.envoy.until_sent(2)
    assert r.envoy.kinds() == ["request_headers", None]  # continue, then "wait longer"
    timer = sent[1].override_message_timeout
    assert (timer.seconds, timer.nanos) == (13, 500_000_000)  # prefill_s + 1
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    call = r.prefill.calls[0]
    request_id = call.request_id
    assert (call.endpoint, call.path, call.timeout_s) == (P, "/v1/completions", 12.5)
    assert call.headers == {"authorization": "Bearer k"}  # only dispatch.forward_headers
    p_body = r.prefill.body
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["kv_transfer_params"]["transfer_id"] == f"xfer-{request_id}"
    assert len(r.envoy.sent) == 2  # D is not answered before P

    r.prefill.answer(P_ANSWER)
    sent = await r.envoy.until_sent(3)
    d_body, set_headers = routed(sent[2])
    assert d_body == REQUEST | {"kv_transfer_params": P_ANSWER}  # P's params, verbatim
    assert set_headers["x-gateway-destination-endpoint"] == f"{D1},{D2}"  # with a fallback
    assert set_headers["x-request-id"] == request_id != "c-1"
    assert r.rt.identities.get(P) == identity_from_params(P_ANSWER)
    assert r.processor.client_request_id == "c-1"

    await r.send(response_headers(200))
    await r.envoy.until_sent(4)
    assert r.envoy.kinds()[3] == "response_headers"
    await r.end()
    assert r.outcome("ok", "serial", "cache_miss") == 1
    assert r.sample("pd_extproc_prefill_leg_seconds_sum", outcome="ok") == 0.125
    assert r.sample("pd_extproc_processing_seconds_count") == 1
    assert r.sample("pd_extproc_dispatch_skew_seconds_count") == 0
    assert [name for name, _ in r.trace.events] == [
        "prefill_started",
        "prefill_finished",
        "decode_started",
        "decode_answered",
        "finish",
    ]
    assert r.trace.events[1][1] == "ok" and r.trace.events[3][1] == 200
    assert r.trace.events[-1][1] == {
        "request_id": request_id,
        "client_request_id": "c-1",
        "strategy": "serial",
        "reason": "cache_miss",
        "outcome": "ok",
        "prefill": P,
    }
    assert r.idle() and r.rt.active_streams == 0


async def test_chat_and_max_completion_tokens_reach_p() -> None:
    r = Request()
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9,
        "min_tokens": 2,
    }
    await r.start(chat, path="/v1/chat/completions")
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    assert r.prefill.calls[0].path == "/v1/chat/completions"
    p_body = r.prefill.body
    assert (p_body["max_tokens"], p_body["max_completion_tokens"]) == (1, 1)
    assert "min_tokens" not in p_body
    r.prefill.answer(P_ANSWER)
    d_body, _ = routed((await r.envoy.until_sent(3))[2])
    assert d_body["max_completion_tokens"] == 9 and d_body["min_tokens"] == 2
    await r.end()


@pytest.mark.parametrize(
    ("failure", "status", "label"),
    [
        (PrefillFailed(502, "prefill endpoint p answered 500"), 502, "prefill_error"),
        (PrefillTimeout(504, "prefill endpoint p did not answer"), 504, "prefill_timeout"),
    ],
)
async def test_serial_p_failure_ends_the_request_and_drops_the_identity(
    failure: Exception, status: int, label: str
) -> None:
    r = Request(cached=True, dispatch={"mode": "serial-push"})
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.fail(failure)
    sent = await r.envoy.until_sent(3)
    assert error(sent[2]) == (status, str(failure).split(" ", 1)[1], None)
    await asyncio.wait_for(r.task, WAIT_S)  # the request ends without Envoy's help
    assert r.rt.identities.get(P) is None
    assert next(iter(r.rt.prefill)).healthy  # P answered: it is not unreachable
    assert r.outcome(label, "serial", "serial_only") == 1
    assert r.sample("pd_extproc_prefill_leg_seconds_count", outcome=label) == 1
    assert ("prefill_finished", label) in r.trace.events
    assert r.idle()


async def test_unreachable_p_is_marked_unhealthy_and_the_client_may_retry() -> None:
    r = Request()
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.fail(PrefillUnreachable(503, "prefill endpoint p is unreachable", retry_after_s=1))
    sent = await r.envoy.until_sent(3)
    assert error(sent[2]) == (503, "prefill endpoint p is unreachable", "1")
    await asyncio.wait_for(r.task, WAIT_S)
    assert not next(iter(r.rt.prefill)).healthy
    assert r.outcome("prefill_unreachable", "serial", "cache_miss") == 1


@pytest.mark.parametrize("params", [None, IDENTITY | {"remote_port": 0}])
async def test_unusable_p_params_are_never_forwarded(params: Any) -> None:
    r = Request(cached=True, dispatch={"mode": "serial-push"})
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.answer(params)
    sent = await r.envoy.until_sent(3)
    status, message, _ = error(sent[2])
    assert status == 502
    assert message == "the prefill engine sent unusable kv_transfer_params"  # no address
    assert r.rt.identities.get(P) is None
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.outcome("prefill_error", "serial", "serial_only") == 1


async def test_client_gone_while_p_computes_cancels_p() -> None:
    r = Request()
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    await r.end()  # Envoy closes the stream
    assert r.prefill.cancelled.is_set()
    assert r.envoy.kinds() == ["request_headers", None]  # nothing written for D
    assert r.outcome("cancelled", "serial", "cache_miss") == 1
    assert r.idle()


# ---- parallel ------------------------------------------------------------------------------


async def test_parallel_dispatch_sends_both_legs_at_once() -> None:
    r = Request(cached=True)
    await r.start()
    sent = await r.envoy.until_sent(2)
    assert r.envoy.kinds() == ["request_headers", "request_body"]  # no wait for P
    assert r.prefill.called.is_set()
    d_body, set_headers = routed(sent[1])
    request_id = set_headers["x-request-id"]
    transfer_id = r.prefill.body["kv_transfer_params"]["transfer_id"]
    assert transfer_id == f"xfer-{request_id}" and r.prefill.calls[0].request_id == request_id
    identity = identity_from_params(IDENTITY)
    d_params = identity.decode_params(request_id, transfer_id)
    assert d_body == REQUEST | {"kv_transfer_params": d_params}
    assert r.sample("pd_extproc_dispatch_skew_seconds_count") == 1
    r.prefill.answer(P_ANSWER)  # the same engine: nothing to say
    await r.send(response_headers(200))
    await r.envoy.until_sent(3)
    await r.end()
    assert r.envoy.kinds()[2:] == ["response_headers"]
    assert r.rt.identities.get(P) == identity
    assert r.outcome("ok", "parallel", "cache_hit") == 1
    assert r.idle()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_p_restart_after_its_answer_ends_a_stream_still_owed_its_kv(stream: bool) -> None:
    # D's 200 passed once P answered; P then restarts (a new engine id is learned) before its
    # push could land: the streamed answer is ended at once (Envoy resets it). A whole answer
    # comes once D is done, its KV long there: it is left alone.
    r = Request(cached=True)
    await r.start(REQUEST | {"stream": stream})
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER)
    await r.send(response_headers(200))
    await r.envoy.until_sent(3)
    assert len(r.rt.pushed_kv) == (1 if stream else 0)
    r.rt.identities.learn(P, identity_from_params(IDENTITY | {"remote_engine_id": "e2"}))
    if stream:
        sent = await r.envoy.until_sent(4)
        assert error(sent[3]) == (
            503,
            "the prefill engine restarted or stopped before its KV reached the decode engine;"
            " retry",
            "1",
        )
        await asyncio.wait_for(r.task, WAIT_S)
        assert r.outcome("kv_lost", "parallel", "cache_hit") == 1
    else:
        await r.end()
        assert r.envoy.kinds()[2:] == ["response_headers"]
        assert r.outcome("ok", "parallel", "cache_hit") == 1
    assert len(r.rt.pushed_kv) == 0 and r.idle()


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_a_p_going_down_after_a_serial_answer_ends_a_push_stream_only(mode: str) -> None:
    # Serial push: D registers once it has P's params, P writes after that, so a P lost after
    # its answer leaves D waiting too. Pull: D reads P's blocks itself and fails if P is gone.
    r = Request()
    await r.start(REQUEST | {"stream": True})
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER | {"transfer_mode": mode})
    await r.envoy.until_sent(3)  # D's body, with P's params
    await r.send(response_headers(200))
    await r.envoy.until_sent(4)
    r.rt.prefill.set_healthy(P, False)  # its health check failed
    if mode == "push":
        sent = await r.envoy.until_sent(5)
        assert error(sent[4])[0] == 503
        await asyncio.wait_for(r.task, WAIT_S)
        assert r.outcome("kv_lost", "serial", "cache_miss") == 1
    else:
        await r.end()
        assert r.outcome("ok", "serial", "cache_miss") == 1
    assert len(r.rt.pushed_kv) == 0


async def test_a_streams_owed_push_is_kept_until_a_lost_p_can_be_seen() -> None:
    """Landing time plus two health-check rounds (a failed check, or the restart's new
    engine id learnt by the probe that follows), under the engine that answered."""
    health = {"interval_s": 3.0, "timeout_s": 0.5}
    r = Request(health=health, timeouts={"pushed_kv_s": 2.0})
    await r.start(REQUEST | {"stream": True})
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(3)
    await r.send(response_headers(200))
    await r.envoy.until_sent(4)
    ((owed,),) = r.rt.pushed_kv._owed.values()  # the one stream's
    assert (owed.endpoint, owed.engine_id) == (P, "e1")
    assert owed.kept_until - owed.landed_by == pytest.approx(2 * (3.0 + 0.5))
    await r.end()


async def test_p_restarted_under_a_parallel_request_is_a_retryable_503() -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER | {"remote_engine_id": "e2"})
    sent = await r.envoy.until_sent(3)
    assert error(sent[2]) == (503, "the prefill engine restarted (new engine id); retry", "1")
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.rt.identities.get(P).engine_id == "e2"  # learned for the next request
    assert r.sample("pd_extproc_identity_events_total", endpoint=P, event="mismatched") == 1
    assert r.outcome("identity_changed", "parallel", "cache_hit") == 1


async def test_parallel_p_failure_after_d_answered_still_ends_the_request() -> None:
    r = Request(cached=True)
    sent = await r.p_fails_after_both_legs_left()
    assert error(sent[2])[0] == 502
    assert r.rt.identities.get(P) is None


async def test_pull_engines_and_flapping_endpoints_are_served_serially() -> None:
    pull = Request(cached=False)
    pull.rt.identities.learn(P, identity_from_params(IDENTITY | {"transfer_mode": "pull"}))
    await pull.start()
    await pull.envoy.until_sent(2)
    assert pull.envoy.kinds()[1] is None  # the serial "wait longer"
    await pull.end()
    assert pull.outcome("cancelled", "serial", "pull") == 1


# ---- D's answer ----------------------------------------------------------------------------


async def test_d_5xx_drops_the_identity_it_was_given_and_cancels_p() -> None:
    r = Request(cached=True, timeouts={"decode_error_grace_s": 0.1})
    await r.start()
    await r.envoy.until_sent(2)
    await r.send(response_headers(503))  # P has not answered within the grace
    sent = await r.envoy.until_sent(4)
    timer = sent[2].override_message_timeout
    assert (timer.seconds, timer.nanos) == (1, 100_000_000)  # grace + 1
    assert r.envoy.kinds()[3] == "response_headers"  # D's error goes to the client as it is
    assert r.prefill.cancelled.is_set()
    assert r.rt.identities.get(P) is None
    await r.end()
    assert r.outcome("decode_5xx", "parallel", "cache_hit") == 1
    assert ("decode_answered", 503) in r.trace.events


async def test_d_5xx_then_p_answers_the_same_engine_in_the_grace() -> None:
    r = Request(cached=True, timeouts={"decode_error_grace_s": 30})
    await r.start()
    await r.envoy.until_sent(2)
    await r.send(response_headers(500))
    await r.envoy.until_sent(3)  # the grace has begun
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(4)
    assert r.envoy.kinds()[3] == "response_headers"
    assert r.rt.identities.get(P) is None  # D failed with it: learn it again
    assert not r.prefill.cancelled.is_set()
    await r.end()


async def test_d_5xx_then_p_answers_a_new_engine_in_the_grace() -> None:
    r = Request(cached=True, timeouts={"decode_error_grace_s": 30})
    await r.start()
    await r.envoy.until_sent(2)
    await r.send(response_headers(500))
    await r.envoy.until_sent(3)
    r.prefill.answer(P_ANSWER | {"remote_engine_id": "e2"})
    sent = await r.envoy.until_sent(4)
    assert error(sent[3])[0] == 503
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.rt.identities.get(P).engine_id == "e2"


async def test_envoys_own_reply_passes_at_once_keeps_the_identity_and_cancels_p() -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    reply = response_headers(503)  # Envoy's own: no D was reached
    fields = reply.attributes["envoy.filters.http.ext_proc"].fields
    fields[REPLY_DETAILS].string_value = "no_healthy_upstream"
    await r.send(reply)
    await r.envoy.until_sent(3)
    assert r.envoy.kinds()[2] == "response_headers"  # it goes to the client as it is
    await asyncio.wait_for(r.prefill.cancelled.wait(), WAIT_S)
    assert r.rt.identities.get(P) == identity_from_params(IDENTITY)  # D said nothing of P
    await r.end()


async def settled_parallel(r: Request) -> None:
    """A parallel request whose P answered (as the engine D was given) before D's headers."""
    await r.start()
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER)
    await until_true(
        lambda: r.sample("pd_extproc_prefill_leg_seconds_count", outcome="ok") == 1, "P settled"
    )


async def test_d_5xx_drops_only_the_identity_it_was_given() -> None:
    # P restarted after its answer and the probe learnt its new engine before D failed: D's
    # failure says nothing about the new engine, which is kept
    r = Request(cached=True)
    await settled_parallel(r)
    r.rt.identities.learn(P, identity_from_params(IDENTITY | {"remote_engine_id": "e2"}))
    await r.send(response_headers(500))
    await r.envoy.until_sent(3)
    assert r.rt.identities.get(P) == identity_from_params(IDENTITY | {"remote_engine_id": "e2"})
    await r.end()


async def test_d_5xx_in_serial_drops_the_identity_p_gave() -> None:
    r = Request()
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(3)
    await r.send(response_headers(502))
    await r.envoy.until_sent(4)
    assert r.envoy.kinds()[3] == "response_headers"
    assert r.rt.identities.get(P) is None
    await r.end()
    assert r.outcome("decode_5xx", "serial", "cache_miss") == 1


@pytest.mark.parametrize(("status", "dropped"), [(400, False), (500, True), (502, True)])
async def test_only_a_d_that_answered_below_400_owes_a_push_and_5xx_drops_the_identity(
    status: int, dropped: bool
) -> None:
    r = Request()
    await r.start(REQUEST | {"stream": True})
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.answer(P_ANSWER)  # a push engine
    await r.envoy.until_sent(3)
    await r.send(response_headers(status))
    await r.envoy.until_sent(4)
    assert len(r.rt.pushed_kv) == 0  # D refused or failed: nothing is on its way to it
    assert (r.rt.identities.get(P) is None) is dropped
    await r.end()


async def test_d_4xx_passes_at_once_keeps_the_identity_and_cancels_p() -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    await r.send(response_headers(400))
    await r.envoy.until_sent(3)
    assert r.envoy.kinds()[2] == "response_headers"  # D's refusal is the answer: not held
    assert r.rt.identities.get(P) is not None
    await r.end()
    assert r.prefill.cancelled.is_set()  # P's answer cannot change D's refusal
    assert r.outcome("client_error", "parallel", "cache_hit") == 1  # D refused the request


async def test_d_below_400_is_held_until_p_answers_and_keeps_the_identity() -> None:
    r = Request(cached=True, timeouts={"prefill_s": 7})
    await r.start()
    await r.envoy.until_sent(2)
    await r.send(response_headers(399))
    sent = await r.envoy.until_sent(3)
    assert r.envoy.kinds()[2] is None  # held: Envoy's timer extended for P's answer
    assert sent[2].override_message_timeout.seconds == 8  # prefill_s + 1
    assert r.rt.identities.get(P) is not None and not r.prefill.cancelled.is_set()
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(4)
    assert r.envoy.kinds()[3] == "response_headers"
    await r.end()
    assert r.rt.identities.get(P) == identity_from_params(P_ANSWER)
    assert r.outcome("ok", "parallel", "cache_hit") == 1


async def test_an_approximated_prompt_counts_as_ds_once_ds_answer_passes_after_ps() -> None:
    """kv_cache with neither events nor a tokenizer: the prompt's blocks count as sent to P and
    D at once (routing), and as reached on D (the decode-only decision's) only once D's answer
    passes, which a parallel plan holds until P has answered."""
    pools = {"prefill": {"endpoints": [P]}, "decode": {"endpoints": [D1, D2]}}
    r = Request(cached=True, **{k: v | {"policy": "kv_cache"} for k, v in pools.items()})
    sent = r.rt.kv.routed_bytes
    await r.start(REQUEST | {"prompt": "z" * 600})
    await r.envoy.until_sent(2)
    keys, decode = r.processor.plan.kv_keys, r.processor.plan.decodes[0]  # type: ignore[union-attr]
    assert set(sent.held(keys)) == {P, decode} and len(keys) == 4  # 600 bytes: 4 full blocks
    await r.send(response_headers(200))
    await r.envoy.until_sent(3)  # held for P
    assert sent.landed(keys) == {}
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(4)
    assert sent.landed(keys) == {decode: 4 * 128}
    await r.end()


async def test_an_approximated_prompt_d_failed_never_counts_as_ds() -> None:
    pools = {"prefill": {"endpoints": [P]}, "decode": {"endpoints": [D1, D2]}}
    r = Request(cached=True, **{k: v | {"policy": "kv_cache"} for k, v in pools.items()})
    await r.start(REQUEST | {"prompt": "z" * 600})
    await r.envoy.until_sent(2)
    keys = r.processor.plan.kv_keys
    await r.send(response_headers(503))
    r.prefill.answer(P_ANSWER)
    await r.end()
    assert keys and r.rt.kv.routed_bytes.landed(keys) == {}


# ---- picking -------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.requests: list[PickRequest] = []

    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState:
        self.requests.append(request)
        return candidates[-1]


async def test_policies_see_the_model_session_and_prompt_start() -> None:
    r = Request(cached=True, dispatch={"session_header": "x-conversation"})
    decode, prefill = Recorder(), Recorder()
    r.rt.scheduler.groups[""].pickers.update(decode=decode, prefill=prefill)
    long_prompt = "x" * 5000
    await r.start(REQUEST | {"prompt": long_prompt}, x_conversation="conv-7")
    sent = await r.envoy.until_sent(2)
    raw_member = b'"prompt":"' + long_prompt.encode()
    expected = PickRequest("m", "conv-7", raw_member[:4096], len(raw_member) + 1)  # + '"'

    assert decode.requests == [expected] and prefill.requests == [expected]
    assert routed(sent[1])[1]["x-gateway-destination-endpoint"] == f"{D2},{D1}"
    await r.end()


async def test_chat_messages_are_the_prompt_start_and_no_session_is_none() -> None:
    r = Request()
    decode = Recorder()
    r.rt.scheduler.groups[""].pickers["decode"] = decode
    await r.start(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, path="/v1/chat/completions"
    )
    await r.envoy.until_sent(2)
    assert decode.requests == [
        PickRequest("m", None, b'"messages":[{"role":"user","content":"hi"}]', 43)
    ]
    await r.end()


async def test_in_flight_is_counted_on_the_chosen_endpoints_while_the_request_runs() -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    counts = {s.address: s.in_flight for s in [*r.rt.prefill, *r.rt.decode]}
    assert counts == {P: 1, D1: 1, D2: 0}  # the fallback is not counted
    await r.end()
    assert r.idle()


async def test_no_healthy_decode_is_a_retryable_503_and_p_is_not_asked() -> None:
    r = Request()
    for address in (D1, D2):
        r.rt.decode.set_healthy(address, False)
    await r.start()
    sent = await r.envoy.until_sent(2)
    assert error(sent[1]) == (503, "no healthy decode endpoint; retry later", "1")
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.prefill.calls == [] and r.idle()
    assert r.outcome("no_healthy_decode", "none", "none") == 1


async def test_no_healthy_prefill_is_a_retryable_503_by_default() -> None:
    r = Request()
    r.rt.prefill.set_healthy(P, False)
    await r.start()
    sent = await r.envoy.until_sent(2)
    assert error(sent[1]) == (503, "no healthy prefill endpoint; retry later", "1")
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.idle()


async def test_no_healthy_prefill_can_fall_back_to_decode_only() -> None:
    r = Request(dispatch={"no_healthy_prefill": "decode_only"})
    r.rt.prefill.set_healthy(P, False)
    await r.start(REQUEST | {"kv_transfer_params": {"remote_host": "evil"}})
    sent = await r.envoy.until_sent(2)
    d_body, set_headers = routed(sent[1])
    assert d_body == REQUEST  # the client's own kv_transfer_params never reach D
    assert set_headers["x-gateway-destination-endpoint"] == f"{D1},{D2}"
    await r.send(response_headers(500))
    await r.envoy.until_sent(3)
    await r.end()
    assert r.prefill.calls == []
    assert r.outcome("decode_5xx", "decode_only", "no_prefill") == 1
    assert r.trace.events[-1][1]["prefill"] is None


# ---- the headers and body phases ------------------------------------------------------------


async def test_bad_body_is_refused_with_400_before_any_leg() -> None:
    r = Request()
    await r.start({"model": "m"})
    sent = await r.envoy.until_sent(2)
    assert error(sent[1]) == (
        400,
        "'prompt' must be a string or a list of token ids (it is missing)",
        None,
    )
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.prefill.calls == [] and r.idle()
    assert r.outcome("client_error", "none", "none") == 1


async def test_envoys_own_reply_in_the_body_phase_is_let_through() -> None:
    r = Request()
    await r.send(headers(), response_headers(413))  # Envoy refused an oversized body itself
    sent = await r.envoy.until_sent(2)
    assert r.envoy.kinds() == ["request_headers", "response_headers"]
    assert sent[1].response_headers == ep.HeadersResponse()
    assert labels(sent[1]) == {"strategy": "none", "model": "none"}  # for Envoy's access log
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.outcome("client_error", "none", "none") == 1


@pytest.mark.parametrize("first", [aio.EOF, body(REQUEST)], ids=["stream ended", "no headers"])
async def test_a_stream_without_request_headers_is_left_alone(first: Any) -> None:
    r = Request()
    await r.send(first)
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.envoy.sent == [] and r.prefill.calls == []
    assert r.outcome("cancelled", "none", "none") == 1


async def test_stream_ending_after_the_headers_writes_nothing_more() -> None:
    r = Request()
    await r.send(headers(), aio.EOF)
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.envoy.kinds() == ["request_headers"]


async def test_request_log_line_names_the_request(caplog: pytest.LogCaptureFixture) -> None:
    r = Request(cached=True, log={"requests": True})
    with caplog.at_level(logging.INFO, logger="extproc.request.parse"):
        await r.start(x_request_id="client-9")
        sent = await r.envoy.until_sent(2)
        r.prefill.answer(P_ANSWER)  # D's 200 passes (held until P answers, it would not)
        await r.send(response_headers(200))
        await r.envoy.until_sent(3)
        await r.end()
    request_id = routed(sent[1])[1]["x-request-id"]
    [line] = [rec for rec in caplog.records if rec.getMessage() == f"request {request_id} ok"]
    assert (line.client_request_id, line.strategy, line.reason, line.prefill) == (
        "client-9",
        "parallel",
        "cache_hit",
        P,
    )


async def test_no_request_log_line_unless_asked(caplog: pytest.LogCaptureFixture) -> None:
    r = Request(cached=True)
    with caplog.at_level(logging.INFO, logger="extproc.request.parse"):
        await r.start()
        await r.envoy.until_sent(2)
        await r.end()
    assert not [rec for rec in caplog.records if hasattr(rec, "outcome")]
    [line] = [rec.getMessage() for rec in caplog.records]
    assert line.endswith(": stream ended before P answered")  # the parallel P was cut short


# ---- bounds, timings and what an operator reads ------------------------------------------------


async def test_serial_processing_time_leaves_out_the_wait_for_p() -> None:
    r = Request()
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    asyncio.get_running_loop().call_later(0.6, r.prefill.answer, P_ANSWER)  # P takes 0.6 s
    await r.envoy.until_sent(3)
    await r.end()
    assert 0 <= r.sample("pd_extproc_processing_seconds_sum") < 0.3


async def test_parallel_skew_and_processing_time_are_small_and_positive() -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    await r.end()
    assert 0 <= r.sample("pd_extproc_dispatch_skew_seconds_sum") < 0.3
    assert 0 <= r.sample("pd_extproc_processing_seconds_sum") < 0.3


async def test_failed_p_leg_time_is_measured_from_its_start() -> None:
    r = Request()
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.fail(PrefillFailed(502, "boom"))
    await asyncio.wait_for(r.task, WAIT_S)
    assert 0 <= r.sample("pd_extproc_prefill_leg_seconds_sum", outcome="prefill_error") < 1


async def test_every_request_gets_its_own_id() -> None:
    ids = []
    for _ in range(2):
        r = Request(cached=True)
        await r.start()
        ids.append(routed((await r.envoy.until_sent(2))[1])[1]["x-request-id"])
        await r.end()
    assert ids[0] != ids[1]


async def test_an_endpoints_own_mode_overrides_the_dispatch_mode() -> None:
    r = Request(cached=True, prefill={"endpoints": [{"address": P, "mode": "pull"}]})
    await r.start()
    await r.envoy.until_sent(2)
    assert r.envoy.kinds()[1] is None  # serial although a push identity is cached
    await r.end()
    assert r.outcome("cancelled", "serial", "pull") == 1


async def test_a_flapping_prefill_is_served_serially() -> None:
    r = Request(cached=True, dispatch={"flap_threshold": 1})
    r.rt.identities.learn(P, identity_from_params(IDENTITY | {"remote_engine_id": "e2"}))
    await r.start()
    await r.envoy.until_sent(2)
    assert r.envoy.kinds()[1] is None
    await r.end()
    assert r.outcome("cancelled", "serial", "serial_only") == 1


async def test_requests_go_only_to_their_models_engines() -> None:
    other_p, other_d = "127.0.0.1:9100", "127.0.0.1:9200"
    models = {"b": {"prefill": {"endpoints": [other_p]}, "decode": {"endpoints": [other_d]}}}
    r = Request(models=models)
    await r.start(REQUEST | {"model": "b"})
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    assert r.prefill.calls[0].endpoint == other_p
    r.prefill.answer(P_ANSWER)
    _, set_headers = routed((await r.envoy.until_sent(3))[2])
    assert set_headers["x-gateway-destination-endpoint"] == other_d
    await r.end()


async def test_a_stale_d_failure_does_not_evict_a_newer_identity() -> None:
    r = Request(cached=True, timeouts={"decode_error_grace_s": 0.05})
    await r.start()
    await r.envoy.until_sent(2)
    newer = identity_from_params(IDENTITY | {"remote_engine_id": "e2"})
    r.rt.identities.learn(P, newer)  # another request learned P's new engine meanwhile
    await r.send(response_headers(503))
    await r.envoy.until_sent(4)
    assert r.rt.identities.get(P) == newer
    await r.end()


async def test_a_response_without_status_is_let_through() -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    await r.send(ep.ProcessingRequest(response_headers=ep.HttpHeaders()))
    await r.envoy.until_sent(3)  # held like any answer below 400 until P is settled
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(4)
    await r.end()
    assert r.envoy.kinds()[2:] == [None, "response_headers"]


async def test_headers_without_a_body_are_refused() -> None:
    r = Request()
    await r.send(headers(end=True))
    sent = await r.envoy.until_sent(1)
    assert error(sent[0]) == (400, "the request has no body; send a JSON object", None)
    await asyncio.wait_for(r.task, WAIT_S)


async def test_a_client_without_the_engines_key_is_refused_at_its_headers(
    tmp_path: Path,
) -> None:
    """Where P gets the sidecar's key, the client's is checked before the body is even read."""
    key_file = tmp_path / "key"
    key_file.write_text("sk-engines\n")
    keyed = {
        "engines": {"api_key_file": str(key_file)},
        "dispatch": {"forward_headers": ["traceparent"]},
    }
    r = Request(**keyed)
    await r.send(headers(authorization="Bearer sk-other"))  # the body never comes
    sent = await r.envoy.until_sent(1)
    status, message, _ = error(sent[0])
    assert (status, message.split(":")[0]) == (401, "Unauthorized")
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.prefill.calls == [] and r.idle()
    r = Request(**keyed)
    await r.start(authorization="bearer sk-engines")  # vLLM's scheme is case-insensitive
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    assert "authorization" not in (r.prefill.calls[0].headers or {})  # P gets the sidecar's key
    await r.end()


@pytest.mark.parametrize("messages", [0, 1], ids=["no headers", "no body"])
async def test_a_silent_envoy_does_not_hold_the_request(
    monkeypatch: pytest.MonkeyPatch, messages: int
) -> None:
    monkeypatch.setattr("extproc.request.processor._BODY_WAIT_S", 0.05)
    r = Request()
    await r.send(*[headers()][:messages])
    await asyncio.wait_for(r.task, WAIT_S)
    assert len(r.envoy.sent) == messages and r.prefill.calls == []


async def test_watching_stops_after_request_s() -> None:
    r = Request(cached=True, timeouts={"request_s": 0.1})
    await r.start()
    await r.envoy.until_sent(2)
    await asyncio.wait_for(r.task, WAIT_S)  # neither P nor D ever answers
    assert r.prefill.cancelled.is_set() and r.idle()


def _reload(rt: Runtime, **timeouts: float) -> None:
    rt.reload(
        fixed_routing_config(
            {"prefill": {"endpoints": [P]}, "decode": {"endpoints": [D1, D2]}, "timeouts": timeouts}
        )
    )


async def test_a_reload_keeps_the_grace_of_a_request_in_flight_and_gives_the_next_its_own() -> None:
    r = Request(cached=True, timeouts={"decode_error_grace_s": 30})
    await r.send(headers())
    await r.envoy.until_sent(1)  # the headers passed; the body is on its way
    _reload(r.rt, decode_error_grace_s=0.05)
    await r.send(body(REQUEST))
    await r.envoy.until_sent(2)
    await r.send(response_headers(503))
    timer = (await r.envoy.until_sent(3))[2].override_message_timeout
    assert (timer.seconds, timer.nanos) == (31, 0)  # the grace it started with, + 1
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(4)
    await r.end()

    after = Request(cached=True, runtime=r.rt)
    await after.start()
    await after.envoy.until_sent(2)
    await after.send(response_headers(503))
    timer = (await after.envoy.until_sent(3))[2].override_message_timeout
    assert (timer.seconds, timer.nanos) == (1, 50_000_000)  # the reloaded grace, + 1
    await after.end()


async def test_a_reload_keeps_the_request_s_of_a_request_in_flight() -> None:
    r = Request(cached=True, timeouts={"request_s": 0.1})
    await r.send(headers())
    await r.envoy.until_sent(1)
    _reload(r.rt, request_s=30)
    after = Request(cached=True, runtime=r.rt)  # started after the reload: 30 s
    await after.start()
    await after.envoy.until_sent(2)  # watching P and D from here
    await r.send(body(REQUEST))
    await r.envoy.until_sent(2)
    await asyncio.wait_for(r.task, WAIT_S)  # its own 0.1 s ended the watch
    assert r.prefill.cancelled.is_set()
    assert not after.task.done()  # began watching first, and is still watching
    await after.end()


async def test_what_is_reported_for_a_stream_that_never_started() -> None:
    r = Request()
    await r.send(aio.EOF)
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.trace.events == [
        (
            "finish",
            {
                "request_id": "",
                "client_request_id": "",
                "strategy": "none",
                "reason": "none",
                "outcome": "cancelled",
                "prefill": None,
            },
        )
    ]


async def test_refused_requests_have_no_request_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = Request(log={"requests": True})
    with caplog.at_level(logging.INFO, logger="extproc.request.parse"):
        await r.start({"model": "m"})
        await asyncio.wait_for(r.task, WAIT_S)
    assert caplog.records == []  # no id was given to it: nothing to name
    assert r.trace.events[-1][1]["request_id"] == ""
    assert r.trace.events[-1][1]["client_request_id"] == ""


async def test_leg_failures_are_logged_with_both_ids(caplog: pytest.LogCaptureFixture) -> None:
    r = Request()
    with caplog.at_level(logging.WARNING, logger="extproc.request.parse"):
        await r.start(x_request_id="c-2")
        await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
        r.prefill.fail(PrefillFailed(502, "prefill endpoint p answered 500"))
        await asyncio.wait_for(r.task, WAIT_S)
    request_id = r.prefill.calls[0].request_id
    [line] = caplog.records
    assert line.getMessage() == (
        f"request {request_id} (client id 'c-2') failed: 502 prefill endpoint p answered 500"
    )
    assert (line.outcome, line.request_id, line.prefill) == ("prefill_error", request_id, P)


async def test_dispatch_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    r = Request(cached=True)
    with caplog.at_level(logging.DEBUG, logger="extproc.request.parse"):
        await r.start(x_request_id="c-3")
        sent = await r.envoy.until_sent(2)
        await r.end()
    request_id = routed(sent[1])[1]["x-request-id"]
    messages = [rec.getMessage() for rec in caplog.records]
    assert f"request {request_id} (client id 'c-3'): parallel/cache_hit P={P} D={D1}" in messages
    assert f"request {request_id}: stream ended before P answered" in messages


async def test_no_stream_ended_line_when_there_was_no_p_leg(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = Request()
    with caplog.at_level(logging.INFO, logger="extproc.request.parse"):
        await r.send(headers(), aio.EOF)
        await asyncio.wait_for(r.task, WAIT_S)
    assert caplog.records == []


async def test_no_stream_ended_line_once_d_has_answered(caplog: pytest.LogCaptureFixture) -> None:
    r = Request(cached=True)
    with caplog.at_level(logging.INFO, logger="extproc.request.parse"):
        await r.start()
        await r.envoy.until_sent(2)
        await r.send(response_headers(200))  # D answered; P is still running
        await r.envoy.until_sent(3)
        await r.end()
    assert caplog.records == [] and r.prefill.cancelled.is_set()


async def test_the_kv_check_hears_which_d_was_sent_kv_and_which_prefills_itself() -> None:
    # the decode's first choice: D1 (both idle); its counts make the KV check's windows
    r = Request()
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.answer(P_ANSWER)
    sent = await r.envoy.until_sent(3)
    assert routed(sent[2])[1]["x-gateway-destination-endpoint"].split(",")[0] == D1
    await r.end()
    assert dict(r.rt.kv_check._dispatched) == {D1: 1} and not r.rt.kv_check._alone
    alone = Request(dispatch={"no_healthy_prefill": "decode_only"})
    alone.rt.prefill.set_healthy(P, False)
    await alone.start()
    sent = await alone.envoy.until_sent(2)
    assert routed(sent[1])[1]["x-gateway-destination-endpoint"] == f"{D1},{D2}"
    await alone.end()
    body_bytes = len(sent[1].request_body.response.body_mutation.body)
    assert dict(alone.rt.kv_check._alone) == {D1: body_bytes}
    assert not alone.rt.kv_check._dispatched


async def test_no_stream_ended_line_for_decode_only(caplog: pytest.LogCaptureFixture) -> None:
    r = Request(dispatch={"no_healthy_prefill": "decode_only"})
    r.rt.prefill.set_healthy(P, False)
    with caplog.at_level(logging.INFO, logger="extproc.request.parse"):
        await r.start()
        await r.envoy.until_sent(2)
        await r.end()
    assert caplog.records == []


# ---- labels for Envoy's access log (the client's latency) and the model label -------------


async def test_d_answer_carries_the_requests_labels_for_the_access_log() -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER)
    await r.send(response_headers(200))
    sent = await r.envoy.until_sent(3)
    await r.end()
    assert labels(sent[2]) == {"strategy": "parallel", "model": "m"}  # D accepted "m"
    assert (
        r.sample(
            "pd_extproc_requests_total",
            outcome="ok",
            strategy="parallel",
            reason="cache_hit",
            model="m",
        )
        == 1
    )


async def test_with_envoys_access_log_open_a_started_answer_is_left_to_its_entry() -> None:
    r = Request(cached=True)
    r.rt.access_log_streams.open = 1  # Envoy streams its access log to this process
    await r.start()
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER)
    await r.send(response_headers(200))
    sent = await r.envoy.until_sent(3)
    await r.end()
    # the entry will count it, by what Envoy saw of the stream (`extproc.request.access_log`)
    assert labels(sent[2]) == {"strategy": "parallel", "model": "m", "reason": "cache_hit"}
    assert (
        r.sample(
            "pd_extproc_requests_total",
            outcome="ok",
            strategy="parallel",
            reason="cache_hit",
            model="m",
        )
        is None
    )
    assert r.rt.access_log_streams.awaiting == 1


async def test_an_answer_left_to_its_entry_is_not_counted_again_if_cancelled_while_written() -> (
    None
):
    """Envoy ends the stream while the labelled answer is still being flushed: the entry has
    the reason and counts the request, so the processor must not count it as well."""
    r = Request(cached=True)
    r.rt.access_log_streams.open = 1
    flushed = asyncio.Event()  # never set: the write is still in flight when the task ends
    write = r.envoy.write

    async def write_then_flush(message: Any) -> None:
        if message.WhichOneof("response") != "response_headers":
            return await write(message)
        r.envoy.sent.append(message)  # handed to the transport
        r.envoy.answered.set()
        await flushed.wait()

    r.envoy.write = write_then_flush  # type: ignore[method-assign]
    await r.start()
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER)
    await r.send(response_headers(200))
    sent = await r.envoy.until_sent(3)
    assert labels(sent[2])["reason"] == "cache_hit"
    r.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(r.task, WAIT_S)
    counted = r.sample(
        "pd_extproc_requests_total",
        outcome="ok",
        strategy="parallel",
        reason="cache_hit",
        model="m",
    )
    assert counted is None and r.rt.access_log_streams.awaiting == 1


async def test_a_prefill_refusing_the_request_is_a_client_error() -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    r.prefill.fail(PrefillFailed(404, "prefill endpoint p answered 404: no such model"))
    sent = await r.envoy.until_sent(3)
    await asyncio.wait_for(r.task, WAIT_S)
    assert error(sent[2])[0] == 404
    assert r.outcome("client_error", "parallel", "cache_hit") == 1


@pytest.mark.parametrize(("status", "kept"), [(400, True), (499, True), (500, False)])
async def test_a_prefill_that_refused_the_request_keeps_its_identity(
    status: int, kept: bool
) -> None:
    r = Request(cached=True)
    await r.start()
    await r.envoy.until_sent(2)
    r.prefill.fail(PrefillFailed(status, f"prefill endpoint p answered {status}"))
    await r.envoy.until_sent(3)
    await asyncio.wait_for(r.task, WAIT_S)
    assert (r.rt.identities.get(P) is not None) is kept  # a 4xx says nothing of the engine


@pytest.mark.parametrize("status", [400, 404])
async def test_a_model_the_decode_refuses_is_labelled_other(status: int) -> None:
    r = Request()
    await r.start(REQUEST | {"model": "invented"})
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(3)
    await r.send(response_headers(status))  # vLLM: a bad request, or no such model
    sent = await r.envoy.until_sent(4)
    await r.end()
    assert labels(sent[3]) == {"strategy": "serial", "model": "other"}
    assert (
        r.sample(
            "pd_extproc_requests_total",
            outcome="client_error",
            strategy="serial",
            reason="cache_miss",
            model="other",
        )
        == 1
    )


async def test_a_served_model_is_its_own_label_and_errors_carry_labels_too() -> None:
    r = Request(cached=True)
    r.rt.model_labels.served("m")  # as the identity probe learns it from /v1/models
    sent = await r.p_fails_after_both_legs_left()
    assert error(sent[2])[0] == 502
    assert labels(sent[2]) == {"strategy": "parallel", "model": "m"}
    assert (
        r.sample(
            "pd_extproc_requests_total",
            outcome="prefill_error",
            strategy="parallel",
            reason="cache_hit",
            model="m",
        )
        == 1
    )


async def test_a_configured_model_is_its_own_label() -> None:
    models = {
        "m": {
            "prefill": {"endpoints": ["127.0.0.1:9101"]},
            "decode": {"endpoints": ["127.0.0.1:9102"]},
        }
    }
    r = Request(models=models)
    await r.start(REQUEST | {"model": "invented"})
    await r.envoy.until_sent(2)
    assert r.rt.model_labels.label("m") == "m"
    assert r.rt.model_labels.label("invented") == "other"  # configured, served or accepted only
    assert r.rt.model_labels.label("") == "none"
    await r.end()


async def test_a_model_no_decode_answered_is_labelled_other() -> None:
    r = Request(p_leg=ScriptedPrefill(PrefillFailed(500, "prefill failed")))
    await r.start(REQUEST | {"model": "invented"})
    answer = (await r.envoy.until_sent(3))[2]  # after the headers and the timer
    assert answer.WhichOneof("response") == "immediate_response"
    await r.end()
    models = {
        sample.labels["model"]
        for metric in r.rt.metrics.registry.collect()
        if metric.name == "pd_extproc_requests"
        for sample in metric.samples
        if sample.name.endswith("_total")
    }
    assert models == {"other"}  # never served: the name is not learnt


# ---- owed pushes and data-parallel ranks ----------------------------------------------------


class Clock:
    """The owed pushes' clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def owed_serial_push(r: Request) -> None:
    """A streamed serial push request through D's 200: the push P answered for is owed."""
    await r.start(REQUEST | {"stream": True})
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(3)  # D's body, with P's params
    await r.send(response_headers(200))
    await r.envoy.until_sent(4)
    assert len(r.rt.pushed_kv) == 1


async def test_an_owed_push_is_kept_until_a_lost_p_can_be_seen() -> None:
    # P's push lands within pushed_kv_s of its answer, but P's loss is seen only after two
    # failed health checks: a P down past the landing time still owed the stream its KV
    clock = Clock()
    r = Request(timeouts={"pushed_kv_s": 1}, health={"interval_s": 2, "timeout_s": 1})
    r.rt.pushed_kv._clock = clock
    await owed_serial_push(r)
    clock.now += 1 + 2 * (2 + 1) - 0.5  # past the landing time, within two health rounds
    r.rt.prefill.set_healthy(P, False)
    sent = await r.envoy.until_sent(5)
    assert error(sent[4])[0] == 503
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.outcome("kv_lost", "serial", "cache_miss") == 1


async def test_a_ranks_new_engine_ends_the_streams_that_rank_owed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # each rank of a data-parallel P is an engine of its own: the push is owed by rank 1
    r = Request(prefill={"endpoints": [P], "data_parallel_size": 2})
    state = r.rt.prefill.get(P)
    assert state is not None
    state.next_rank = 1  # the rank the least-loaded choice tries first
    await owed_serial_push(r)
    [leg] = r.prefill.calls
    assert leg.headers is not None and leg.headers[RANK_HEADER] == "1"
    # rank 1's engine restarted (its new identity learnt from an answer or the probe)
    r.rt.identities.learn(P, identity_from_params(IDENTITY | {"remote_engine_id": "e2"}), 1)
    sent = await r.envoy.until_sent(5)
    assert error(sent[4])[0] == 503
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.outcome("kv_lost", "serial", "cache_miss") == 1
    assert f"reached the decode engine; retry (prefill {P} dp1, engine e1)" in caplog.text


async def test_a_ranks_new_engine_ends_the_parallel_streams_that_rank_owed() -> None:
    r = Request(prefill={"endpoints": [P], "data_parallel_size": 2})
    r.rt.identities.learn(P, identity_from_params(IDENTITY), 1)  # rank 1's engine is known
    state = r.rt.prefill.get(P)
    assert state is not None
    state.next_rank = 1
    await r.start(REQUEST | {"stream": True})
    await r.envoy.until_sent(2)  # D's body with rank 1's identity: no wait for P
    [leg] = r.prefill.calls
    assert leg.headers is not None and leg.headers[RANK_HEADER] == "1"
    r.prefill.answer(P_ANSWER)
    await r.send(response_headers(200))
    await r.envoy.until_sent(3)
    assert len(r.rt.pushed_kv) == 1
    r.rt.identities.learn(P, identity_from_params(IDENTITY | {"remote_engine_id": "e2"}), 1)
    sent = await r.envoy.until_sent(4)
    assert error(sent[3])[0] == 503
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.outcome("kv_lost", "parallel", "cache_hit") == 1


async def test_d_5xx_in_serial_drops_the_identity_of_the_rank_p_answered_from() -> None:
    # D failed with rank 1's identity: that rank's is learnt again, rank 0's is kept
    r = Request(prefill={"endpoints": [P], "data_parallel_size": 2})
    rank_0 = identity_from_params(IDENTITY | {"remote_engine_id": "e0"})
    r.rt.identities.learn(P, rank_0, 0)
    state = r.rt.prefill.get(P)
    assert state is not None
    state.next_rank = 1
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.answer(P_ANSWER)
    await r.envoy.until_sent(3)
    assert r.rt.identities.get(P, 1) == identity_from_params(IDENTITY)
    await r.send(response_headers(502))
    await r.envoy.until_sent(4)
    assert r.rt.identities.get(P, 1) is None
    assert r.rt.identities.get(P, 0) == rank_0
    await r.end()


def dp_request(rank: int) -> Request:
    """A request to a P of two data-parallel ranks, to go to rank `rank`."""
    r = Request(prefill={"endpoints": [P], "data_parallel_size": 2})
    state = r.rt.prefill.get(P)
    assert state is not None
    state.next_rank = rank
    return r


async def test_unusable_params_from_a_rank_drop_that_ranks_identity_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = dp_request(1)
    rank_0 = identity_from_params(IDENTITY | {"remote_engine_id": "e0"})
    r.rt.identities.learn(P, rank_0, 0)
    await r.start()
    await asyncio.wait_for(r.prefill.called.wait(), WAIT_S)
    r.prefill.answer(None)  # rank 1 answered no kv_transfer_params
    sent = await r.envoy.until_sent(3)
    assert error(sent[2])[0] == 502
    await asyncio.wait_for(r.task, WAIT_S)
    assert r.rt.identities.get(P, 0) == rank_0
    assert f"unusable kv_transfer_params (prefill {P}: " in caplog.text  # the operator's detail


async def test_a_rank_that_fails_loses_its_identity_alone() -> None:
    r = dp_request(1)
    rank_0 = identity_from_params(IDENTITY | {"remote_engine_id": "e0"})
    r.rt.identities.learn(P, rank_0, 0)
    r.rt.identities.learn(P, identity_from_params(IDENTITY), 1)  # parallel, with rank 1's
    sent = await r.p_fails_after_both_legs_left()
    assert error(sent[2])[0] == 502
    assert r.rt.identities.get(P, 1) is None and r.rt.identities.get(P, 0) == rank_0


async def test_a_ranks_new_engine_in_ps_answer_is_counted_and_logged_under_that_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = dp_request(1)
    r.rt.identities.learn(P, identity_from_params(IDENTITY), 1)  # parallel, with rank 1's
    await r.start()
    await r.envoy.until_sent(2)
    r.prefill.answer(P_ANSWER | {"remote_engine_id": "e2"})
    sent = await r.envoy.until_sent(3)
    assert error(sent[2])[0] == 503
    await asyncio.wait_for(r.task, WAIT_S)
    events = "pd_extproc_identity_events_total"
    assert r.sample(events, endpoint=f"{P} dp1", event="mismatched") == 1
    assert f"restarted (new engine id); retry (prefill {P} dp1)" in caplog.text


@pytest.mark.parametrize("first_rank", [0, 3], ids=["rank-the-fallback-has", "rank-it-lacks"])
async def test_a_serial_retry_chooses_its_rank_at_the_fallback(first_rank: int) -> None:
    prefill = ScriptedPrefill(PrefillBusy(502, "prefill endpoint answered 503"))
    r = Request(
        p_leg=prefill,
        prefill={
            "endpoints": [P, {"address": P2, "data_parallel_size": 2}],
            "data_parallel_size": 4,
        },
        dispatch={"mode": "serial_push"},
        timeouts={"prefill_s": 10},
    )
    first, fallback = r.rt.prefill.get(P), r.rt.prefill.get(P2)
    assert first is not None and fallback is not None
    first.next_rank = first_rank
    fallback.rank_load = {0: 5.0, 1: 0.0}  # other routers' requests queue at its rank 0
    await r.start()
    first_leg, retry = await prefill.until_called(2)
    assert (first_leg.endpoint, retry.endpoint) == (P, P2)
    assert first_leg.headers is not None and first_leg.headers[RANK_HEADER] == str(first_rank)
    assert retry.headers is not None and retry.headers[RANK_HEADER] == "1"  # its least loaded
    prefill.answer(P_ANSWER)
    await r.envoy.until_sent(3)
    assert r.rt.identities.get(P2, 1) == identity_from_params(IDENTITY)
    await r.send(response_headers(200))
    await r.envoy.until_sent(4)
    await r.end()
    assert r.idle()


async def test_a_big_body_lets_the_loop_run_between_decoding_it_and_finding_its_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """10^5 chat messages cost ~50 ms to decode and as much to scan for the members, each on
    a quiet core: one step would stall the loop for both."""
    from extproc.request import processor

    ran_between: list[bool] = []
    small_ran = asyncio.Event()

    def decode(*args: Any) -> Any:
        asyncio.get_running_loop().call_soon(small_ran.set)  # a small request's ready step
        return real_decode(*args)

    def members_of(*args: Any) -> Any:
        ran_between.append(small_ran.is_set())
        return real_members(*args)

    real_decode, real_members = processor.decode_request, processor.client_request
    monkeypatch.setattr(processor, "decode_request", decode)
    monkeypatch.setattr(processor, "client_request", members_of)
    r = Request()
    await r.start({**REQUEST, "prompt": "w " * (1 << 19)})  # a 1 MiB body: a big one
    await r.envoy.until_sent(2)
    await r.end()
    assert ran_between == [True]
