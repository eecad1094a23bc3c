"""Admission control's priorities: read only from the gateway's header, parsed strictly,
clamped to the configured range, and never above the limits."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from extproc.config import AdmissionConfig, AdmissionLimits
from extproc.errors import Shed
from extproc.scheduling.admission import (
    check_admission,
    parse_priority,
    request_priority,
    role_saturation,
    shedding_point,
)

LIMITS = AdmissionLimits(max_in_flight=4)
CLIENT_SET = AdmissionConfig(enabled=True, decode=LIMITS)  # no header trusted
GATEWAY_SET = AdmissionConfig(enabled=True, decode=LIMITS, priority_header="X-Gateway-Priority")


class Invalid:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def priority(headers: dict[str, str], config: AdmissionConfig = GATEWAY_SET) -> int:
    return request_priority(headers, config, Invalid())


@pytest.mark.parametrize("value", ["0", "-2", "7", "000012", "-999999"])
def test_a_plain_ascii_integer_is_parsed(value: str) -> None:
    assert parse_priority(value) == int(value)


@pytest.mark.parametrize(
    "value",
    ["1_000", "٣", "１", "+1", " 1", "1 ", "--1", "-", "", "1.0", "0x10", "high", "1234567"],
)
def test_anything_else_is_not_a_priority(value: str) -> None:
    assert parse_priority(value) is None


def test_by_default_no_header_is_trusted() -> None:
    assert CLIENT_SET.priority_header is None
    for name in ("x-request-priority", "x-priority", "priority"):
        assert priority({name: "100"}, CLIENT_SET) == 0
        assert priority({name: "-4"}, CLIENT_SET) == 0


def test_the_gateways_header_is_clamped_to_the_range() -> None:
    assert GATEWAY_SET.priority_header == "x-gateway-priority"
    assert priority({"x-gateway-priority": "-1"}) == -1
    assert priority({"x-gateway-priority": "100"}) == 0  # priority_max
    assert priority({"x-gateway-priority": "-4"}) == -3  # priority_min
    assert priority({"x-request-priority": "-2"}) == 0  # not the configured header
    assert priority({}) == 0
    switched_off = GATEWAY_SET.model_copy(update={"enabled": False})
    assert priority({"x-gateway-priority": "-2"}, switched_off) == 0


def test_a_malformed_value_gets_the_default_and_is_counted() -> None:
    config = GATEWAY_SET.model_copy(update={"priority_default": -1})
    invalid = Invalid()
    for value in ("1_000", "٣", "high"):
        assert request_priority({"x-gateway-priority": value}, config, invalid) == -1
    assert invalid.count == 3
    assert request_priority({"x-gateway-priority": "0"}, config, invalid) == 0
    assert invalid.count == 3


def test_the_top_priority_is_shed_at_the_limits_and_lower_ones_earlier() -> None:
    check_admission(0, "decode", 0.99, GATEWAY_SET)
    for level, saturated in ((0, 1.0), (-1, 0.75), (-2, 0.5), (-3, 0.25)):
        with pytest.raises(Shed, match="the decode engines are saturated") as shed:
            check_admission(level, "decode", saturated, GATEWAY_SET)
        assert shed.value.status == 429 and shed.value.retry_after_s == 1
    # out of range: clamped here too, so nothing passes the limits or is shed on idle engines
    with pytest.raises(Shed):
        check_admission(100, "decode", 1.0, GATEWAY_SET)
    check_admission(-100, "decode", 0.0, GATEWAY_SET)
    assert shedding_point(-100, GATEWAY_SET) == 0.25


def test_levels_count_down_from_the_configured_top() -> None:
    config = AdmissionConfig(enabled=True, priority_min=1, priority_max=4, priority_default=2)
    assert [shedding_point(p, config) for p in (4, 3, 2, 1)] == [1.0, 0.75, 0.5, 0.25]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"priority_min": -4}, "priority_min -4 would be shed at 0% of the limits"),
        ({"priority_min": -2, "priority_step": 0.5}, "raise priority_min or lower priority_step"),
        ({"priority_default": 1}, "priority_default 1 is outside priority_min -3 .. priority_max"),
        ({"priority_header": "bad header"}, "'bad header' is not a valid header name"),
    ],
)
def test_a_range_that_sheds_on_idle_engines_is_refused(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        AdmissionConfig.model_validate({"enabled": True, **settings})


def test_a_role_without_members_is_not_saturated() -> None:
    """No member: no 429 from admission, the pick answers 503 (nothing can serve)."""
    assert role_saturation([], LIMITS) == 0.0
