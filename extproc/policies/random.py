"""random: a uniformly random healthy endpoint."""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.policies.base import E, NoOptions, PickRequest

__all__ = ["RandomPicker"]


class RandomPicker:
    """Uniformly random; no shared state, so it cannot herd (useful with many sidecars)."""

    def __init__(self, options: NoOptions | None = None, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        return self._rng.choice(candidates)
