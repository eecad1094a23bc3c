"""kv_cache: the engine that holds most of the prompt in its KV cache, weighed against its load.

Each candidate scores `kv_cache_weight × share − load`: `share` is the prompt's leading tokens
it holds (from the engines' KV events: `PickRequest.cached`, full blocks × block size) over the
prompt's tokens, `load` its requests in flight from here plus its queue at the last scrape. A
prompt held whole is worth `kv_cache_weight` requests of load: on P the prefill it saves, on D
the transfer (vLLM's connector asks P only for the blocks D lacks). Ties go to the prompt's
rendezvous order, so equal candidates still spread by prompt.

Where no candidate is known to hold any of the prompt (no events from them, no tokenizer, a
new prompt), the pick is `prefix`'s: rendezvous hashing of the prompt's start with bounded
load, an approximate affinity that needs no events.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from extproc.policies.base import E, PickRequest, hrw_order
from extproc.policies.prefix import PrefixPicker

__all__ = ["KvCacheOptions", "KvCachePicker"]


class KvCacheOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # What a prompt held whole is worth, in requests of load (in flight + queued).
    kv_cache_weight: float = Field(default=4.0, ge=0)


class KvCachePicker:
    def __init__(self, options: KvCacheOptions | None = None) -> None:
        self._weight = (options or KvCacheOptions()).kv_cache_weight
        self._fallback = PrefixPicker()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        cached = request.cached
        if not cached or request.prompt_tokens <= 0 or not any(
            cached.get(c.address, 0) for c in candidates
        ):
            return self._fallback.pick(candidates, request)
        per_token = self._weight / request.prompt_tokens
        order = hrw_order(request.prefix, candidates)
        rank = {id(c): i for i, c in enumerate(order)}
        return max(candidates, key=lambda c: (
            per_token * cached.get(c.address, 0) - c.in_flight - c.waiting, -rank[id(c)]
        ))  # fmt: skip
