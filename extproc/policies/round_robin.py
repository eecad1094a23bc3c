"""round_robin: each healthy endpoint in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from extproc.policies.base import E, NoOptions, PickRequest

__all__ = ["RoundRobinPicker"]


class RoundRobinPicker:
    def __init__(self, options: NoOptions | None = None) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        return candidates[next(self._counter) % len(candidates)]
