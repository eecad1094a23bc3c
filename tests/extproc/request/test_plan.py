"""The dispatch plan: the request, the picks and what is known of P, in one plan."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import orjson
import pytest

from extproc.errors import ClientError
from extproc.policies import PickRequest
from extproc.protocol.identity import PrefillIdentity
from extproc.request.parse import Api, parse_request
from extproc.request.plan import (
    DecodeOnlyPlan,
    ParallelPlan,
    SerialPlan,
    Strategy,
    check_plan_fits,
    plan_legs,
    plan_request,
)
from extproc.scheduling.scheduler import WithPrefill
from extproc.wiring import Runtime
from tests.support.routing import fixed_routing_config

P, D = "127.0.0.1:8100", "127.0.0.1:8200"
ENGINE = PrefillIdentity("e1", "127.0.0.1", 5600, 1, 1, 1, "push")
POOLS = {"prefill": {"endpoints": [P]}, "decode": {"endpoints": [D]}}
REQUEST_BODY = b'{"model": "m", "prompt": "hi"}'
REQUEST = parse_request(Api("/v1/completions"), REQUEST_BODY, 1 << 20)


def _picked(inflight: ExitStack, **config: Any) -> WithPrefill:
    rt = Runtime(fixed_routing_config(POOLS | config), "unix:/x")
    picked = rt.scheduler.pick(PickRequest(), inflight, rt.config)
    assert isinstance(picked, WithPrefill)
    return picked


@pytest.mark.parametrize(
    ("choice", "identity", "kind"),
    [
        ((Strategy.SERIAL, "cache_miss"), None, SerialPlan),
        ((Strategy.PARALLEL, "cache_hit"), ENGINE, ParallelPlan),
    ],
    ids=["serial", "parallel"],
)
def test_plan_per_strategy(
    choice: tuple[Strategy, str], identity: PrefillIdentity | None, kind: type
) -> None:
    with ExitStack() as inflight:
        picked = _picked(inflight)
        plan = plan_legs(REQUEST, "r1", picked, choice, identity)
    assert type(plan) is kind and plan.strategy is choice[0] and plan.reason == choice[1]
    assert (plan.request_id, plan.decodes, plan.prefill) == ("r1", [D], P)
    assert (plan.decode_counted, plan.prefill_counted) == (
        picked.decode_counted,
        picked.prefill_counted,
    )


def test_plan_request_is_the_whole_plan_with_its_counts() -> None:
    rt = Runtime(fixed_routing_config(POOLS), "unix:/x")
    rt.identities.learn(P, ENGINE)
    with ExitStack() as inflight:
        plan = plan_request(REQUEST, {}, rt.config, rt.scheduler, rt.identities, inflight)
        assert isinstance(plan, ParallelPlan) and plan.reason == "cache_hit"
        assert plan.given is ENGINE and plan.decodes == [D] and plan.prefill == P
        assert plan.decode_counted is not None and plan.decode_counted.state.address == D
        assert [s.in_flight for s in (*rt.prefill, *rt.decode)] == [1, 1]
    assert [s.in_flight for s in (*rt.prefill, *rt.decode)] == [0, 0]


def test_without_a_healthy_p_the_plan_is_decode_only_when_allowed() -> None:
    rt = Runtime(
        fixed_routing_config(POOLS | {"dispatch": {"no_healthy_prefill": "decode_only"}}), "unix:/x"
    )
    rt.prefill.set_healthy(P, False)
    with ExitStack() as inflight:
        plan = plan_request(REQUEST, {}, rt.config, rt.scheduler, rt.identities, inflight)
    assert isinstance(plan, DecodeOnlyPlan) and plan.strategy is Strategy.DECODE_ONLY
    assert (plan.reason, plan.decodes, plan.prefill) == ("no_prefill", [D], None)
    assert orjson.loads(bytes(plan.d_body)) == orjson.loads(REQUEST_BODY)


def test_the_plan_reads_the_priority_under_the_snapshot_it_is_given() -> None:
    rt = Runtime(fixed_routing_config(POOLS), "unix:/x")
    headers = {"x-priority": "high"}  # not an integer: counted only where the header is read
    snapshot = fixed_routing_config(
        POOLS | {"admission": {"enabled": True, "priority_header": "x-priority"}}
    )
    invalid = rt.metrics.invalid_priorities
    with ExitStack() as inflight:
        plan_request(REQUEST, headers, rt.config, rt.scheduler, rt.identities, inflight)
        assert invalid._value.get() == 0
        plan_request(REQUEST, headers, snapshot, rt.scheduler, rt.identities, inflight)
        assert invalid._value.get() == 1


def test_parallel_plan_gives_d_the_cached_identity_and_p_the_same_transfer() -> None:
    with ExitStack() as inflight:
        plan = plan_legs(REQUEST, "r1", _picked(inflight), (Strategy.PARALLEL, "cache_hit"), ENGINE)
    assert isinstance(plan, ParallelPlan) and plan.given is ENGINE
    d_params = orjson.loads(bytes(plan.d_body))["kv_transfer_params"]
    p_params = orjson.loads(bytes(plan.p_body))["kv_transfer_params"]
    assert d_params["remote_engine_id"] == "e1" and d_params["remote_request_id"] == "r1"
    assert d_params["transfer_id"] == p_params["transfer_id"] == "xfer-r1"


def test_a_body_over_envoys_buffer_is_refused_before_any_leg_exists() -> None:
    raw = orjson.dumps({"model": "m", "prompt": "x" * 70_000})
    big = parse_request(Api("/v1/completions"), raw, 1 << 20)
    with ExitStack() as inflight:
        plan = plan_legs(big, "r1", _picked(inflight), (Strategy.PARALLEL, "cache_hit"), ENGINE)
    check_plan_fits(plan, 1 << 20)
    with pytest.raises(ClientError) as caught:
        check_plan_fits(plan, 1024)
    assert caught.value.status == 413
