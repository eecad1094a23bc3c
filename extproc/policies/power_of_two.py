"""power_of_two: two random endpoints, the less loaded one, by the engines' own load.

The only policy that needs engine load: the scraper keeps `waiting` and `kv_usage` of its
pool's endpoints fresh every `load_interval_s`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from extproc.durations import INTERVAL
from extproc.policies.base import E, EndpointView, PickRequest, in_flight

__all__ = ["PowerOfTwoOptions", "PowerOfTwoPicker", "load_score"]


class PowerOfTwoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # How often the engines' /metrics are scraped for num_requests_waiting and
    # kv_cache_usage_perc (an engine in several such pools is scraped at the smallest).
    load_interval_s: Annotated[float, INTERVAL] = 1.0
    # A full KV cache counts as this many waiting requests in the load score.
    kv_usage_weight: float = Field(default=4.0, ge=0)


def load_score(state: EndpointView, kv_usage_weight: float) -> float:
    """How busy an endpoint is, in units of "requests queued in front of a new one".

    score = in_flight + waiting + kv_usage_weight × kv_usage

    - `in_flight`: requests this sidecar has there now (exact, instantaneous; every ext_proc
      process's).
    - `waiting`: the engine's `vllm:num_requests_waiting` at the last scrape; it also counts
      requests other routers sent, and requests stuck behind a full KV cache.
    - `kv_usage`: `vllm:kv_cache_usage_perc` (0-1) at the last scrape: a nearly full cache
      means the next request waits for blocks or preempts another, so a full cache weighs as
      much as `kv_usage_weight` queued requests.

    Our own requests that are queued are counted twice (in_flight and waiting); that only
    makes a queueing engine look busier, which is the direction we want. Engines that do not
    export the metrics keep waiting = kv_usage = 0, and the score is the in-flight count.
    """
    return in_flight(state) + state.waiting + kv_usage_weight * state.kv_usage


class PowerOfTwoPicker:
    """Sample two endpoints at random, take the one with the lower `load_score`.

    Sampling (rather than taking the global minimum) matters because `waiting` and `kv_usage`
    are up to one scrape interval old: the global minimum would send every request of that
    interval to the same engine, two random choices spread them and still avoid the busy one.
    """

    def __init__(
        self, options: PowerOfTwoOptions | None = None, rng: random.Random | None = None
    ) -> None:
        self._kv_usage_weight = (options or PowerOfTwoOptions()).kv_usage_weight
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(candidates, 2)
        weight = self._kv_usage_weight
        return second if load_score(second, weight) < load_score(first, weight) else first
