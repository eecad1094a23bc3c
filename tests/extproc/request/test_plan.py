"""The dispatch plan: a pure function of the request, the picks and what is known of P."""

from __future__ import annotations

import orjson
import pytest

from extproc.errors import ClientError
from extproc.protocol.identity import PrefillIdentity
from extproc.request.parse import Api, parse_request
from extproc.request.plan import (
    DecodeOnlyPlan,
    ParallelPlan,
    SerialPlan,
    Strategy,
    check_plan_fits,
    plan_dispatch,
)

P, D = "127.0.0.1:8100", "127.0.0.1:8200"
ENGINE = PrefillIdentity("e1", "127.0.0.1", 5600, 1, 1, 1, "push")
REQUEST = parse_request(Api("/v1/completions"), b'{"model": "m", "prompt": "hi"}', 1 << 20)


@pytest.mark.parametrize(
    ("prefill", "choice", "identity", "kind"),
    [
        (None, (Strategy.DECODE_ONLY, "no_prefill"), None, DecodeOnlyPlan),
        (P, (Strategy.SERIAL, "cache_miss"), None, SerialPlan),
        (P, (Strategy.PARALLEL, "cache_hit"), ENGINE, ParallelPlan),
    ],
    ids=["decode-only", "serial", "parallel"],
)
def test_plan_per_strategy(
    prefill: str | None, choice: tuple[Strategy, str], identity: PrefillIdentity | None,
    kind: type,
) -> None:  # fmt: skip
    plan = plan_dispatch(REQUEST, "r1", [D], prefill, choice, identity)
    assert type(plan) is kind and plan.strategy is choice[0] and plan.reason == choice[1]
    assert (plan.request_id, plan.decodes, plan.prefill) == ("r1", [D], prefill)


def test_parallel_plan_gives_d_the_cached_identity_and_p_the_same_transfer() -> None:
    plan = plan_dispatch(REQUEST, "r1", [D], P, (Strategy.PARALLEL, "cache_hit"), ENGINE)
    assert isinstance(plan, ParallelPlan) and plan.given is ENGINE
    d_params = orjson.loads(plan.d_body)["kv_transfer_params"]
    p_params = orjson.loads(plan.p_body)["kv_transfer_params"]
    assert d_params["remote_engine_id"] == "e1" and d_params["remote_request_id"] == "r1"
    assert d_params["transfer_id"] == p_params["transfer_id"] == "xfer-r1"


def test_a_body_over_envoys_buffer_is_refused_before_any_leg_exists() -> None:
    raw = orjson.dumps({"model": "m", "prompt": "x" * 70_000})
    big = parse_request(Api("/v1/completions"), raw, 1 << 20)
    plan = plan_dispatch(big, "r1", [D], P, (Strategy.PARALLEL, "cache_hit"), ENGINE)
    check_plan_fits(plan, 1 << 20)
    with pytest.raises(ClientError) as caught:
        check_plan_fits(plan, 1024)
    assert caught.value.status == 413
