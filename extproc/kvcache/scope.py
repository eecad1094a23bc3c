"""What besides its tokens an engine's prefix-cache block depends on: its cache scope.

vLLM hashes each block with extra keys: the LoRA adapter's name on every block of an adapter's
request, and the request's `cache_salt` on its first block (so, through the chain, on every
later one). A block is reused only by a request of the same adapter and salt: the index, the
routed-prompt estimate and the lookup all key blocks by that pair, so that a request is
credited only with blocks stored under its own.

A request names its adapter by its `model`: vLLM serves each LoRA adapter under its own model
name. A name is a base model only when an engine said so (the `model_name` label of its
metrics, which vLLM sets to its base model's first served name, or its /v1/models, which lists
every served name, an adapter with its base as `parent`); any other name is keyed as an
adapter, so that a name not yet learnt costs the request its cache credit, never gives it
another's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PLAIN", "CacheScope", "request_scope"]


@dataclass(frozen=True, slots=True)
class CacheScope:
    adapter: str | None = None  # the LoRA adapter's name; None: the base model
    salt: str | None = None  # the request's cache_salt; None: none


PLAIN = CacheScope()


def request_scope(model: str, doc: Mapping[str, Any], base_models: Collection[str]) -> CacheScope:
    """The scope of a request for `model` whose body is `doc`; `base_models`: the names the
    engines serve as their base model. A `cache_salt` that is not a string is kept as its text
    (vLLM refuses it; it must not match anything meanwhile)."""
    salt = doc.get("cache_salt")
    return CacheScope(
        None if model in base_models else model,
        None if salt is None else salt if isinstance(salt, str) else repr(salt),
    )
