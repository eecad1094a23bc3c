"""The client bodies one ext_proc process holds at once, across its requests, bounded.

Each request holds its body (and the copies built from it: the parsed document, the legs'
bodies) until it ends, so many large uploads at once could take any amount of memory. Each
request reserves its body's bytes as they arrive (`limits.max_body_bytes_in_flight`, read
from the request's config snapshot); a chunk that would pass the limit ends the request with
503 + Retry-After before more is read. The reservation is given back when the request ends,
whichever way (answered, refused, the client gone).

The budget also counts its big bodies (`big_bytes` or more) and calls `on_big_bodies_gone`
when the last one is given back: the memory they were copied through can then go back to the
system (`extproc.process.memory_trim`), which small bodies alone never make worth doing.
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.errors import Shed

__all__ = ["BodyBudget", "Reservation"]

RETRY_AFTER_S = 1
BIG_BYTES = 1 << 20


def _nothing() -> None:
    pass


class BodyBudget:
    """The bytes every request of this process has reserved."""

    __slots__ = ("big", "big_bytes", "in_use", "on_big_bodies_gone")

    def __init__(self, big_bytes: int = BIG_BYTES) -> None:
        self.in_use = 0
        self.big_bytes = big_bytes
        self.big = 0  # reservations of big_bytes or more
        self.on_big_bodies_gone: Callable[[], None] = _nothing

    def reservation(self) -> Reservation:
        return Reservation(self)


class Reservation:
    """One request's share of the budget, given back by `release` (idempotent)."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    def take(self, size: int, limit: int) -> None:
        """Reserve `size` more bytes; Shed (503, retryable; counted as outcome `shed`) if the
        process's bodies would pass `limit`."""
        budget = self._budget
        if budget.in_use + size > limit:
            raise Shed(
                503,
                f"the server holds {limit} bytes of request bodies at most and has no room "
                "for this one now; retry shortly",
                retry_after_s=RETRY_AFTER_S,
            )
        budget.in_use += size
        before, self.size = self.size, self.size + size
        if before < budget.big_bytes <= self.size:
            budget.big += 1

    def release(self) -> None:
        budget = self._budget
        budget.in_use -= self.size
        big = self.size >= budget.big_bytes
        self.size = 0
        if big:
            budget.big -= 1
            if not budget.big:
                budget.on_big_bodies_gone()
