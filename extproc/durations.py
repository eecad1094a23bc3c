"""Durations in the config: each one has a range, checked at load with one clear line.

An interval of 1e-9 s would turn a periodic task into a busy loop, and one of 1e9 s would
render an Envoy duration Envoy refuses; the bounds say what is sensible for each kind.
"""

from __future__ import annotations

from pydantic import AfterValidator

__all__ = ["DAY", "INTERVAL", "seconds"]

DAY = 86400.0


def seconds(low: float, high: float) -> AfterValidator:
    """A pydantic validator: the value is a number of seconds within [low, high]."""

    def check(value: float) -> float:
        if not low <= value <= high:  # also refuses nan
            raise ValueError(f"must be between {low:g} and {high:g} seconds (got {value:g})")
        return value

    return AfterValidator(check)


# How often a periodic task runs (health checks, scrapes, DNS): 10 per second at most.
INTERVAL = seconds(0.1, 3600)
