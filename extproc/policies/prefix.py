"""prefix: same prompt start, same engine (prefix-cache hits), within a bound on imbalance."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from extproc.policies.base import E, PickRequest, hrw_order, in_flight
from extproc.policies.least_request import LeastRequestPicker

__all__ = ["PrefixOptions", "PrefixPicker"]


class PrefixOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # How many bytes of the raw prompt/messages JSON are hashed (~4 KV blocks of 16 tokens),
    # and how far above the average in-flight count an endpoint may go before a request spills
    # to the next endpoint of its hash order (more slack: more cache hits, less balance; 0.5
    # kept ~88% affinity at a 56/44 split in bench/results/policies.md).
    prefix_bytes: int = Field(default=256, ge=1, le=4096)
    prefix_load_slack: float = Field(default=0.5, ge=0)


class PrefixPicker:
    """Rendezvous hashing of the prompt's first bytes, with bounded load.

    The key is the first `prefix_bytes` bytes of the raw prompt/messages JSON (the default
    256 bytes is about four 16-token KV blocks of English text): requests that share at least
    that much share an engine. Shorter prompts are hashed whole.

    Bounded load (consistent hashing with bounded loads, Mirrokni et al.): an endpoint takes
    the request only if its in-flight count, the request included, stays within
    ceil((1 + load_slack) × (total in flight + 1) / n); otherwise the next endpoint in the
    key's rendezvous order is tried, so a hot prefix spills over to the same second engine
    each time. The least loaded endpoint always fits, so the walk always ends.
    """

    def __init__(self, options: PrefixOptions | None = None) -> None:
        options = options or PrefixOptions()
        self._prefix_bytes = options.prefix_bytes
        self._load_slack = options.prefix_load_slack
        self._fallback = LeastRequestPicker()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        if not request.prefix:
            return self._fallback.pick(candidates, request)
        order = hrw_order(request.prefix[: self._prefix_bytes], candidates)
        total = sum(in_flight(c) for c in candidates)
        bound = math.ceil((1 + self._load_slack) * (total + 1) / len(candidates))
        return next((c for c in order if in_flight(c) + 1 <= bound), order[0])
