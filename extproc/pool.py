"""Endpoint pools: who is healthy, how busy each endpoint is, and which one to pick.

A picker is a one-method policy over the healthy endpoints; in-flight counts are kept here and
taken/released in one context manager so that no error path can leak a count.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

__all__ = ["EndpointState", "LeastRequestPicker", "Picker", "Pool", "RoundRobinPicker", "picker"]


@dataclass(eq=False)
class EndpointState:
    address: str
    healthy: bool = True
    in_flight: int = 0


class Picker(Protocol):
    def pick(self, candidates: Sequence[EndpointState]) -> EndpointState: ...


class RoundRobinPicker:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[EndpointState]) -> EndpointState:
        return candidates[next(self._counter) % len(candidates)]


class LeastRequestPicker:
    """Fewest in-flight requests; ties broken round robin so equal endpoints share load."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[EndpointState]) -> EndpointState:
        least = min(c.in_flight for c in candidates)
        tied = [c for c in candidates if c.in_flight == least]
        return tied[next(self._counter) % len(tied)]


_PICKERS: dict[str, Callable[[], Picker]] = {
    "round_robin": RoundRobinPicker,
    "least_request": LeastRequestPicker,
}


def picker(name: str) -> Picker:
    return _PICKERS[name]()


class Pool:
    """The endpoints of one role (prefill or decode)."""

    def __init__(
        self,
        role: str,
        addresses: Sequence[str],
        policy: Picker,
        on_change: Callable[[EndpointState], None] = lambda state: None,
    ) -> None:
        self.role = role
        self._endpoints = {a: EndpointState(a) for a in addresses}
        self._policy = policy
        self._on_change = on_change

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(self._endpoints.values())

    def get(self, address: str) -> EndpointState:
        return self._endpoints[address]

    def pick(self, exclude: str | None = None) -> EndpointState | None:
        healthy = [e for e in self._endpoints.values() if e.healthy and e.address != exclude]
        return self._policy.pick(healthy) if healthy else None

    def pick_with_fallback(self) -> list[EndpointState]:
        """The policy's choice, then the next healthy endpoint for Envoy's connect-failure retry.

        The fallback is taken in list order, not from the policy, so it does not advance it.
        """
        first = self.pick()
        if first is None:
            return []
        ordered = list(self._endpoints.values())
        start = ordered.index(first)
        for state in ordered[start + 1 :] + ordered[:start]:
            if state.healthy:
                return [first, state]
        return [first]

    def set_healthy(self, address: str, healthy: bool) -> None:
        state = self._endpoints.get(address)
        if state is not None and state.healthy != healthy:
            state.healthy = healthy
            self._on_change(state)

    @contextmanager
    def track(self, state: EndpointState) -> Iterator[None]:
        state.in_flight += 1
        self._on_change(state)
        try:
            yield
        finally:
            state.in_flight -= 1
            self._on_change(state)
