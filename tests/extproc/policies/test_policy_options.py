"""Policy options from the config reach the policy and change which endpoint is picked."""

from __future__ import annotations

from extproc.config import parse_config
from extproc.policies import PickRequest, build_picker, hrw_order
from extproc.scheduling.pool import EndpointState

PROMPT = b'[{"role":"system","content":"You are a careful assistant."}]'


def endpoints(*in_flight: int) -> list[EndpointState]:
    return [EndpointState(f"10.0.0.{i}:8000", in_flight=n) for i, n in enumerate(in_flight)]


def prefix_picker(**options: object):
    config = parse_config(
        {
            "prefill": {"endpoints": ["127.0.0.1:8100"], "policy": "prefix", **options},
            "decode": {"endpoints": ["127.0.0.1:8200"]},
        }
    )
    return build_picker(config.prefill.policy, config.prefill.options)


def test_configured_load_slack_decides_when_a_prefix_spills() -> None:
    candidates = endpoints(0, 0)
    first, second = hrw_order(PROMPT, candidates)
    first.in_flight = 1  # bound = ceil((1 + slack) × 2 / 2): 1 with slack 0, 2 with 0.5
    request = PickRequest(prefix=PROMPT)
    assert prefix_picker(prefix_load_slack=0.5).pick(candidates, request) is first
    assert prefix_picker(prefix_load_slack=0).pick(candidates, request) is second


def test_configured_prefix_bytes_decide_what_is_hashed() -> None:
    candidates = endpoints(*[0] * 8)
    picker = prefix_picker(prefix_bytes=8)
    picks = {
        picker.pick(candidates, PickRequest(prefix=b"01234567" + bytes([i]) * 9)).address
        for i in range(30)
    }
    assert len(picks) == 1  # only the first 8 bytes count
    spread = {
        prefix_picker().pick(candidates, PickRequest(prefix=b"01234567" + bytes([i]) * 9)).address
        for i in range(30)
    }
    assert len(spread) > 1  # with the default 256 bytes the rest of the prompt counts too


def test_configured_kv_usage_weight_reaches_power_of_two() -> None:
    def picker(weight: float):
        config = parse_config(
            {
                "prefill": {"endpoints": ["127.0.0.1:8100"]},
                "decode": {
                    "endpoints": ["127.0.0.1:8200"],
                    "policy": "power_of_two",
                    "kv_usage_weight": weight,
                },
            }
        )
        return build_picker(config.decode.policy, config.decode.options)

    candidates = endpoints(1, 2)
    candidates[0].kv_usage = 1.0  # scores: weight 0 → 1 vs 2; weight 4 → 5 vs 2
    assert picker(0).pick(candidates, PickRequest()) is candidates[0]
    assert picker(4).pick(candidates, PickRequest()) is candidates[1]
