"""Admission control: shed a request (429 + Retry-After) when its pool is saturated.

An endpoint's saturation is its highest load / limit ratio over the limits configured for its
role (`admission.decode`, `admission.prefill`): requests this ext_proc has in flight there, the
engine's queue (`vllm:num_requests_waiting`) and KV cache fill (`vllm:kv_cache_usage_perc`),
the last two from the engine's own metrics. A role is as saturated as its least saturated
healthy member: a request is shed only when no endpoint has room for it. The prefill role
counts only for a request that will use P (not one the decision serves on D alone).

Priorities: the request's `admission.priority_header` (an integer, 0 when absent) moves its
shedding point to 1 + priority × `priority_step` of the limits. With the default step, -1 is
shed at 75 % of the limits, -2 at 50 %, 0 at 100 %, +1 at 125 %: under rising load the lowest
priorities are shed first, and the highest keep some headroom.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from extproc.config import AdmissionConfig, AdmissionLimits
from extproc.errors import ClientError, Shed
from extproc.policies.base import EndpointView

__all__ = [
    "check_admission",
    "parse_priority",
    "request_priority",
    "role_saturation",
    "saturation",
]

_MAX_PRIORITY = 100  # far beyond any useful level; bounds the arithmetic


def request_priority(headers: Mapping[str, str], config: AdmissionConfig) -> int:
    """The request's priority; 0 (and the header not checked) with admission control off."""
    if not config.enabled:
        return 0
    return parse_priority(headers.get(config.priority_header), config.priority_header)


def parse_priority(value: str | None, header: str) -> int:
    """The header's integer (0 when absent); 400 for anything else."""
    if value is None:
        return 0
    try:
        priority = int(value.strip())
    except ValueError:
        raise ClientError(400, f"{header} must be an integer (got {value[:40]!r})") from None
    return max(-_MAX_PRIORITY, min(_MAX_PRIORITY, priority))


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
    return max(0.0, 1.0 + priority * config.priority_step)


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
