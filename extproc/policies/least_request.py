"""least_request: the fewest requests this sidecar has in flight there."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from extproc.policies.base import E, NoOptions, PickRequest

__all__ = ["LeastRequestPicker"]


class LeastRequestPicker:
    """Fewest in-flight requests; ties broken round robin so equal endpoints share load."""

    def __init__(self, options: NoOptions | None = None) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        least = min(c.in_flight for c in candidates)
        tied = [c for c in candidates if c.in_flight == least]
        return tied[next(self._counter) % len(tied)]
