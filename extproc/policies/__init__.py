"""Endpoint-picking policies, registered by name: which healthy endpoint serves a request.

A policy is one module: a picker class with one method, `pick(candidates, request)`, an
options model (pydantic; its fields are the pool's config keys for that policy), and whether it
reads engine load (then the engine scraper keeps its endpoints' `waiting` / `kv_usage` fresh).
Names are snake_case; the config names them (`prefill.policy`, `decode.policy`, and the same
under `models:`), and an unknown name fails at config load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from extproc.policies.base import EndpointView, NoOptions, Picker, PickRequest, hrw_order
from extproc.policies.kv_cache import KvCacheOptions, KvCachePicker
from extproc.policies.least_request import LeastRequestPicker
from extproc.policies.least_tokens import LeastTokensPicker
from extproc.policies.power_of_two import PowerOfTwoOptions, PowerOfTwoPicker, load_score
from extproc.policies.prefix import PrefixOptions, PrefixPicker
from extproc.policies.random import RandomPicker
from extproc.policies.round_robin import RoundRobinPicker
from extproc.policies.session import SessionPicker

__all__ = [
    "POLICIES",
    "EndpointView",
    "KvCacheOptions",
    "KvCachePicker",
    "LeastRequestPicker",
    "LeastTokensPicker",
    "NoOptions",
    "PickRequest",
    "Picker",
    "Policy",
    "PowerOfTwoOptions",
    "PowerOfTwoPicker",
    "PrefixOptions",
    "PrefixPicker",
    "RandomPicker",
    "RoundRobinPicker",
    "SessionPicker",
    "build_picker",
    "hrw_order",
    "load_score",
    "option_keys",
    "parse_options",
]


@dataclass(frozen=True)
class Policy:
    name: str
    picker: Callable[[Any], Picker]  # called with an instance of `options`
    options: type[BaseModel] = NoOptions
    needs_load: bool = False  # reads the engines' scraped waiting / kv_usage


POLICIES: dict[str, Policy] = {
    policy.name: policy
    for policy in (
        Policy("round_robin", RoundRobinPicker),
        Policy("least_request", LeastRequestPicker),
        Policy("least_tokens", LeastTokensPicker),
        Policy("random", RandomPicker),
        Policy("power_of_two", PowerOfTwoPicker, PowerOfTwoOptions, needs_load=True),
        Policy("session", SessionPicker),
        Policy("prefix", PrefixPicker, PrefixOptions),
        Policy("kv_cache", KvCachePicker, KvCacheOptions, needs_load=True),
    )
}


def option_keys() -> dict[str, str]:
    """Every policy option's config key → the policy it belongs to."""
    return {key: p.name for p in POLICIES.values() for key in p.options.model_fields}


def parse_options(name: str, keys: Mapping[str, Any]) -> BaseModel:
    """The options model of policy `name` from its keys (an unknown key is an error)."""
    return POLICIES[name].options.model_validate(dict(keys))


def build_picker(name: str, options: BaseModel | None = None) -> Picker:
    """A fresh picker of policy `name` (pickers keep state such as a round-robin counter)."""
    policy = POLICIES[name]
    return policy.picker(options if options is not None else policy.options())
