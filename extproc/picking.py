"""Endpoint-picking policies: which healthy endpoint of a pool serves this request.

A policy is one method, `pick(candidates, request)`, over the healthy endpoints (never empty)
and what is known of the request. Policies are registered by name in `POLICIES`; the config
names them (`prefill.policy`, `decode.policy`) and an unknown name fails at config load.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from extproc.pool import EndpointState

__all__ = ["POLICIES", "LeastRequestPicker", "PickRequest", "Picker", "RoundRobinPicker"]


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What a policy may look at; built once per request by the processor."""

    model: str = ""
    session: str | None = None  # the value of the configured session header, if sent
    prefix: bytes = field(default=b"", repr=False)  # the start of the raw prompt/messages JSON


class Picker(Protocol):
    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState: ...


class RoundRobinPicker:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState:
        return candidates[next(self._counter) % len(candidates)]


class LeastRequestPicker:
    """Fewest in-flight requests; ties broken round robin so equal endpoints share load."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState:
        least = min(c.in_flight for c in candidates)
        tied = [c for c in candidates if c.in_flight == least]
        return tied[next(self._counter) % len(tied)]


POLICIES: dict[str, Callable[[], Picker]] = {
    "round_robin": RoundRobinPicker,
    "least_request": LeastRequestPicker,
}
