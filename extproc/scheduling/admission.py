"""Admission control: shed a request (429 + Retry-After) when its pool is saturated.

An endpoint's saturation is its highest load / limit ratio over the limits configured for its
role (`admission.decode`, `admission.prefill`): requests this ext_proc has in flight there, the
engine's queue (`vllm:num_requests_waiting`) and KV cache fill (`vllm:kv_cache_usage_perc`),
the last two from the engine's own metrics. A role is as saturated as its least saturated
healthy member: a request is shed only when no endpoint has room for it. The prefill role
counts only for a request that will use P (not one the decision serves on D alone).

Priorities are the operator's, not the client's: a request's priority comes only from
`admission.priority_header`, a header the gateway sets (and strips from clients); with none
configured (the default) every request has `priority_default`. The value must be a plain
ASCII integer (an optional '-' and up to 6 digits); anything else counts as the default, and it
is clamped to [`priority_min`, `priority_max`]. The limits are hard: the top priority
(`priority_max`) is shed at 100 % of them, each level below it `priority_step` earlier (with
the defaults -1 at 75 %, -2 at 50 %, -3 at 25 %), so under rising load the lowest priorities
are shed first and no priority is admitted above the limits. The config check keeps the
lowest level's shedding point above 0, so a request on idle engines is always admitted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from extproc.config import AdmissionConfig, AdmissionLimits
from extproc.errors import Shed
from extproc.policies.base import EndpointView

__all__ = [
    "check_admission",
    "parse_priority",
    "request_priority",
    "role_saturation",
    "saturation",
    "shedding_point",
]

_INTEGER = re.compile(r"-?[0-9]{1,6}", re.ASCII)  # no '+', '_', spaces or non-ASCII digits


def request_priority(
    headers: Mapping[str, str], config: AdmissionConfig, invalid: Callable[[], None]
) -> int:
    """The request's priority: the trusted header's, clamped, or the default (also with
    admission control off, or no header configured). `invalid` counts a malformed value."""
    header = config.priority_header
    if not config.enabled or header is None or header not in headers:
        return config.priority_default
    priority = parse_priority(headers[header])
    if priority is None:
        invalid()
        return config.priority_default
    return max(config.priority_min, min(config.priority_max, priority))


def parse_priority(value: str) -> int | None:
    """The value's integer, or None for anything but an optional '-' and ASCII digits."""
    return int(value) if _INTEGER.fullmatch(value) else None


def saturation(state: EndpointView, limits: AdmissionLimits) -> float:
    """The endpoint's highest load / limit ratio (0 with no limit set)."""
    ratios = [0.0]
    if limits.max_in_flight is not None:
        ratios.append(state.in_flight / limits.max_in_flight)
    if limits.max_waiting is not None:
        ratios.append(state.waiting / limits.max_waiting)
    if limits.max_kv_usage is not None:
        ratios.append(state.kv_usage / limits.max_kv_usage)
    return max(ratios)


def role_saturation(states: Iterable[EndpointView], limits: AdmissionLimits) -> float:
    """The least saturated member's saturation (0 with no member: the pick refuses then)."""
    return min((saturation(s, limits) for s in states), default=0.0)


def shedding_point(priority: int, config: AdmissionConfig) -> float:
    """The saturation at which a request of `priority` is shed: 1 (the limits) at the top."""
    clamped = max(config.priority_min, min(config.priority_max, priority))
    return 1.0 - (config.priority_max - clamped) * config.priority_step


def check_admission(priority: int, role: str, value: float, config: AdmissionConfig) -> None:
    """Raise Shed (429) if `role`'s saturation `value` reached the request's shedding point."""
    point = shedding_point(priority, config)
    if value >= point:
        raise Shed(
            429,
            f"the {role} engines are saturated ({value:.0%} of their limits; priority "
            f"{priority} is shed at {point:.0%}); retry later",
            retry_after_s=config.retry_after_s,
        )
