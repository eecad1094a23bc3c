"""Endpoint pools: who is healthy, how busy each endpoint is, and which one to pick.

The choice itself is a policy (`extproc.policies`) over the healthy endpoints; in-flight counts
are kept here and taken/released in one context manager so that no error path leaks a count.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from extproc.policies.base import Picker, PickRequest
from extproc.roles import Role

__all__ = ["Counted", "EndpointState", "Pool"]


@dataclass(eq=False)
class EndpointState:
    address: str
    healthy: bool = True
    in_flight: int = 0  # requests this ext_proc has in flight there
    waiting: float = 0.0  # the engine's vllm:num_requests_waiting, when scraped
    running: float = 0.0  # the engine's vllm:num_requests_running, when scraped
    queued_tokens: int = 0  # prefill: prompt tokens of the P legs this ext_proc has there
    # KV-cache routing: the prompt tokens of the requests (legs) counted here that the engine
    # did not hold when they were picked: what it computes (P), or takes in by transfer (D)
    pending_tokens: int = 0
    # the engine's running + waiting requests beyond this ext_proc's in-flight ones at the
    # last scrape: load other routers sent (ours is known exactly, and fresher, in in_flight)
    foreign: float = 0.0
    kv_usage: float = 0.0  # the engine's vllm:kv_cache_usage_perc (0-1), when scraped


_ANY = PickRequest()  # probes and tools: nothing known of the request


class Pool:
    """The endpoints of one role (prefill or decode)."""

    def __init__(
        self,
        role: Role,
        addresses: Sequence[str],
        policy: Picker,
        on_change: Callable[[EndpointState], None] = lambda state: None,
    ) -> None:
        self.role = role
        self._endpoints = {a: EndpointState(a) for a in addresses}
        self._policy = policy
        self._on_change = on_change

    def update(self, addresses: Sequence[str]) -> tuple[list[str], list[str]]:
        """New membership from discovery or a reload: (added, removed) addresses.

        Known endpoints keep their state; new ones start unhealthy until a health check
        passes; removed ones are forgotten here while their in-flight requests finish.
        """
        wanted = list(dict.fromkeys(addresses))
        added = [a for a in wanted if a not in self._endpoints]
        removed = [a for a in self._endpoints if a not in wanted]
        for address in removed:
            del self._endpoints[address]
        for address in added:
            self._endpoints[address] = EndpointState(address, healthy=False)
            self._on_change(self._endpoints[address])
        return added, removed

    def set_policy(self, policy: Picker) -> None:
        self._policy = policy

    @property
    def addresses(self) -> list[str]:
        return list(self._endpoints)

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(list(self._endpoints.values()))  # a copy: membership may change meanwhile

    def pick(
        self,
        request: PickRequest = _ANY,
        among: Collection[str] | None = None,
        policy: Picker | None = None,
    ) -> EndpointState | None:
        """A healthy endpoint (of `among`, a model's members, if given) chosen by `policy`."""
        healthy = [
            e
            for e in self._endpoints.values()
            if e.healthy and (among is None or e.address in among)
        ]
        return (policy or self._policy).pick(healthy, request) if healthy else None

    def pick_with_fallback(
        self,
        request: PickRequest = _ANY,
        among: Collection[str] | None = None,
        policy: Picker | None = None,
        fallbacks: int = 1,
    ) -> list[EndpointState]:
        """The policy's choice, then up to `fallbacks` next healthy endpoints for Envoy's
        connect-failure retry.

        The fallbacks are taken in list order, not from the policy, so they do not advance it.
        """
        first = self.pick(request, among, policy)
        if first is None:
            return []
        ordered = [e for e in self._endpoints.values() if among is None or e.address in among]
        start = ordered.index(first)
        after = [s for s in ordered[start + 1 :] + ordered[:start] if s.healthy]
        return [first, *after[:fallbacks]]

    def set_healthy(self, address: str, healthy: bool) -> None:
        state = self._endpoints.get(address)
        if state is not None and state.healthy != healthy:
            state.healthy = healthy
            self._on_change(state)

    @contextmanager
    def track(self, state: EndpointState, tokens: int = 0) -> Iterator[Counted]:
        """Count one request in flight at `state` until the block ends (or its `release`),
        with `tokens` of work there (`pending_tokens`; they move with it)."""
        counted = Counted(self, state, tokens)
        self._count(state, +1, tokens)
        try:
            yield counted
        finally:
            self.release(counted)
            counted.open = False

    def move(self, counted: Counted, address: str) -> None:
        """Count `counted`'s request at `address` from now on: Envoy's fallback served it, or a
        retry went there (counted again after its release). Nothing once its `track` ended."""
        state = self._endpoints.get(address)
        if not counted.open or state is None:
            return
        if state is counted.state and counted.counting:
            return
        self.release(counted)
        self._count(state, +1, counted.tokens)
        counted.state, counted.counting = state, True

    def release(self, counted: Counted) -> None:
        """Stop counting `counted` (its leg ended before the request did); once only."""
        if counted.counting:
            counted.counting = False
            self._count(counted.state, -1, -counted.tokens)

    def _count(self, state: EndpointState, change: int, tokens: int = 0) -> None:
        state.in_flight += change
        state.pending_tokens += tokens
        self._on_change(state)


class Counted:
    """One request counted in flight at an endpoint of `pool`, from its `track` until that
    ends or, earlier, until `release` (a P leg is counted only while it runs)."""

    def __init__(self, pool: Pool, state: EndpointState, tokens: int = 0) -> None:
        self.pool = pool
        self.state = state
        self.tokens = tokens  # its pending_tokens wherever it is counted
        self.counting = True  # counted at `state` now
        self.open = True  # its `track` has not ended: it may be counted again

    def move_to(self, address: str) -> None:
        self.pool.move(self, address)

    def release(self) -> None:
        self.pool.release(self)
