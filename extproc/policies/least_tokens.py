"""least_tokens (prefill pools): the fewest prompt tokens this sidecar has queued there.

A prefill engine's wait is its queued prompt tokens, not its request count: behind one
4096-token prompt a new request waits as long as behind sixteen 256-token ones. This sidecar
knows the tokens of every P leg it has in flight (estimated from the bodies, see
`decision.bytes_per_token`); ties, such as idle engines, are broken round robin. Endpoints
without the count (decode pools: always 0) tie and fall back to the fewest requests in flight.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from extproc.policies.base import E, EndpointView, NoOptions, PickRequest, in_flight

__all__ = ["LeastTokensPicker"]


def _load(endpoint: EndpointView) -> tuple[int, int]:
    return endpoint.queued_tokens + endpoint.peer_queued_tokens, in_flight(endpoint)


class LeastTokensPicker:
    def __init__(self, options: NoOptions | None = None) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        least = min(_load(c) for c in candidates)
        tied = [c for c in candidates if _load(c) == least]
        return tied[next(self._counter) % len(tied)]
