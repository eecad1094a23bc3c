"""Endpoint-picking policies: which healthy endpoint of a pool serves this request.

A policy is one method, `pick(candidates, request)`, over the healthy endpoints (never empty;
the pool filters unhealthy ones) and what is known of the request. Policies are registered by
name in `POLICIES`; the config names them (`prefill.policy`, `decode.policy`) and an unknown
name fails at config load. `build_picker` passes a pool's policy options to its policy.

Every hash here is blake2b, never Python's `hash()`: that one is salted per process, and
stickiness must survive a restart of the sidecar and agree between replicas of it.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from extproc.config import PoolConfig
    from extproc.pool import EndpointState

__all__ = [
    "ENGINE_LOAD_POLICIES",
    "POLICIES",
    "LeastRequestPicker",
    "PickRequest",
    "Picker",
    "PowerOfTwoPicker",
    "PrefixPicker",
    "RandomPicker",
    "RoundRobinPicker",
    "SessionPicker",
    "build_picker",
    "hrw_order",
    "load_score",
]


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


class RandomPicker:
    """Uniformly random; no shared state, so it cannot herd (useful with many sidecars)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState:
        return self._rng.choice(candidates)


def load_score(state: EndpointState, kv_usage_weight: float) -> float:
    """How busy an endpoint is, in units of "requests queued in front of a new one".

    score = in_flight + waiting + kv_usage_weight × kv_usage

    - `in_flight`: requests this sidecar has there now (exact, instantaneous).
    - `waiting`: the engine's `vllm:num_requests_waiting` at the last scrape; it also counts
      requests other routers sent, and requests stuck behind a full KV cache.
    - `kv_usage`: `vllm:kv_cache_usage_perc` (0-1) at the last scrape: a nearly full cache
      means the next request waits for blocks or preempts another, so a full cache weighs as
      much as `kv_usage_weight` queued requests.

    Our own requests that are queued are counted twice (in_flight and waiting); that only
    makes a queueing engine look busier, which is the direction we want. Engines that do not
    export the metrics keep waiting = kv_usage = 0, and the score is the in-flight count.
    """
    return state.in_flight + state.waiting + kv_usage_weight * state.kv_usage


class PowerOfTwoPicker:
    """Sample two endpoints at random, take the one with the lower `load_score`.

    Sampling (rather than taking the global minimum) matters because `waiting` and `kv_usage`
    are up to one scrape interval old: the global minimum would send every request of that
    interval to the same engine, two random choices spread them and still avoid the busy one.
    """

    def __init__(self, kv_usage_weight: float = 4.0, rng: random.Random | None = None) -> None:
        self._kv_usage_weight = kv_usage_weight
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(candidates, 2)
        weight = self._kv_usage_weight
        return second if load_score(second, weight) < load_score(first, weight) else first


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _hrw_weight(key: bytes, address: str) -> int:
    mixed = hashlib.blake2b(key + address.encode(), digest_size=8).digest()
    return int.from_bytes(mixed, "big")


def hrw_order(key: bytes, candidates: Sequence[EndpointState]) -> list[EndpointState]:
    """Rendezvous (highest random weight) order of the candidates for `key`.

    Each (key, endpoint) pair gets an independent pseudo-random weight; the key belongs to
    the endpoint with the highest. Removing an endpoint moves only the keys it had (each to
    its own second choice, so they spread evenly); adding one takes ~1/n of every other's.
    """
    digest = _digest(key)
    return sorted(candidates, key=lambda c: _hrw_weight(digest, c.address), reverse=True)


class SessionPicker:
    """One conversation, one endpoint: rendezvous hashing of the session header's value.

    The endpoint holds the conversation's earlier turns in its prefix cache. Requests without
    the header are spread by in-flight count (least_request).
    """

    def __init__(self) -> None:
        self._fallback = LeastRequestPicker()

    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState:
        if not request.session:
            return self._fallback.pick(candidates, request)
        return hrw_order(request.session.encode(), candidates)[0]


class PrefixPicker:
    """Same prompt start, same engine (prefix-cache hits), within a bound on imbalance.

    The key is the first `prefix_bytes` bytes of the raw prompt/messages JSON (the default
    256 bytes is about four 16-token KV blocks of English text): requests that share at least
    that much share an engine. Shorter prompts are hashed whole.

    Bounded load (consistent hashing with bounded loads, Mirrokni et al.): an endpoint takes
    the request only if its in-flight count, the request included, stays within
    ceil((1 + load_slack) × (total in flight + 1) / n); otherwise the next endpoint in the
    key's rendezvous order is tried, so a hot prefix spills over to the same second engine
    each time. The least loaded endpoint always fits, so the walk always ends.
    """

    def __init__(self, prefix_bytes: int = 256, load_slack: float = 0.5) -> None:
        self._prefix_bytes = prefix_bytes
        self._load_slack = load_slack
        self._fallback = LeastRequestPicker()

    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState:
        if not request.prefix:
            return self._fallback.pick(candidates, request)
        order = hrw_order(request.prefix[: self._prefix_bytes], candidates)
        total = sum(c.in_flight for c in candidates)
        bound = math.ceil((1 + self._load_slack) * (total + 1) / len(candidates))
        return next((c for c in order if c.in_flight + 1 <= bound), order[0])


POLICIES: dict[str, Callable[[], Picker]] = {
    "round_robin": RoundRobinPicker,
    "least_request": LeastRequestPicker,
    "random": RandomPicker,
    "power_of_two": PowerOfTwoPicker,
    "session": SessionPicker,
    "prefix": PrefixPicker,
}

# Policies that read the engines' scraped `waiting` / `kv_usage` (extproc.load keeps them).
ENGINE_LOAD_POLICIES = frozenset({"power_of_two"})


def build_picker(pool: PoolConfig) -> Picker:
    """The pool's policy with its options from the config."""
    if pool.policy == "power_of_two":
        return PowerOfTwoPicker(kv_usage_weight=pool.kv_usage_weight)
    if pool.policy == "prefix":
        return PrefixPicker(prefix_bytes=pool.prefix_bytes, load_slack=pool.prefix_load_slack)
    return POLICIES[pool.policy]()
