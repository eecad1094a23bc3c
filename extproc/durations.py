"""Durations in the config: each one has a range, checked at load with one clear line.

An interval of 1e-9 s would turn a periodic task into a busy loop, and one of 1e9 s would
render an Envoy duration Envoy refuses; the bounds say what is sensible for each kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import core_schema

__all__ = ["DAY", "INTERVAL", "Seconds", "seconds"]

DAY = 86400.0


@dataclass(frozen=True, slots=True)
class Seconds:
    """Annotated metadata: a number of seconds within [low, high], checked with one clear line
    and published in the JSON schema (the Helm chart's values.schema.json refuses it too)."""

    low: float
    high: float

    def check(self, value: float) -> float:
        if not self.low <= value <= self.high:  # also refuses nan
            raise ValueError(
                f"must be between {self.low:g} and {self.high:g} seconds (got {value:g})"
            )
        return value

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {**handler(schema), "minimum": self.low, "maximum": self.high}


seconds = Seconds  # reads as `Annotated[float, seconds(0.1, 3600)]` in the config


# How often a periodic task runs (health checks, scrapes, DNS): 10 per second at most.
INTERVAL = seconds(0.1, 3600)
