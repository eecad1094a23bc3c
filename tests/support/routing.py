"""Configs for unit tests of something other than routing: round robin and no decision
(`extproc.testing.fixed_routing` says why)."""

from __future__ import annotations

from typing import Any

from extproc.config import Config, parse_config
from extproc.testing import fixed_routing

__all__ = ["fixed_routing_config"]


def fixed_routing_config(data: dict[str, Any]) -> Config:
    return parse_config(fixed_routing(data))
