"""least_request: the fewest requests this sidecar has in flight there."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from extproc.policies.base import E, NoOptions, PickRequest, in_flight

__all__ = ["LeastRequestPicker"]


class LeastRequestPicker:
    """Fewest in-flight requests; ties broken round robin so equal endpoints share load."""

    def __init__(self, options: NoOptions | None = None) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        least = min(in_flight(c) for c in candidates)
        tied = [c for c in candidates if in_flight(c) == least]
        return tied[next(self._counter) % len(tied)]
