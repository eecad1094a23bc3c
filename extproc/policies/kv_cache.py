"""kv_cache: the engine where the request is served soonest, counting what its KV cache holds.

Everything is counted in prompt tokens of work, so that a cached prefix and a queue weigh in
the same unit (a token's prefill cost cancels out). Each candidate scores

    kv_cached_token_weight × cached − (pending_tokens + (in flight + foreign) × kv_request_tokens)

`cached` is the prompt's leading tokens it holds (from the engines' KV events:
`PickRequest.cached`, full blocks × block size): on P the prefill not computed, on D the KV not
transferred (vLLM's connector asks P only for the blocks D lacks). The scheduler gives the
prefill pool a P's events' view raised to what this sidecar sent it (`sent_or_held`), so that
a prompt P evicted goes back there. The rest is the work ahead
of the request there: `pending_tokens`, the tokens of this sidecar's requests in flight there
that the engine did not hold when they were picked (raised at the pick, so a burst sees it at
once), and a fixed cost per request (ours in flight, and others' seen at the last scrape) for
what a request costs beyond its tokens. A cached token counts twice by default: once for this
request's wait, once for the requests queued after it on that engine, which sending it where
the prompt must be computed again would delay by as much (and a second copy of the prefix
takes cache room from others). So the engine holding the prompt wins until the work queued
there exceeds twice what its cache saves; then the next request goes where it waits least.
On a light load (an engine idle, at most one of our requests in flight at the candidate) the
first count is this request's own only for the tokens that are settled there
(`EndpointView.settled`): a prefix the index already credits to an engine while it is still
being computed for our request in flight there saves the next one nothing an idle engine
would not give it sooner; counted, it had the second request of a new prompt in an opening
burst queue a step behind the first. Under load a second copy delays those queued after it.
Ties go to the prompt's rendezvous order, so equal candidates still spread by prompt.

The ranks of a data-parallel server are scored the same way, each as an engine of its own
(`pick_rank`): the cached tokens of each rank's events against the requests queued at that
rank (ours in flight there and the engine's scraped waiting + running), in the same units.

For an engine that publishes no events, `cached` counts the prompt's leading blocks this sidecar
routed there (an estimate: evictions are not seen). Where the prompts are not tokenized (no
tokenizer or no `kv_events`), `prompt_tokens` and `cached` are estimated from the prompt's raw
bytes and what of them this sidecar sent each engine (`kv_approximate`), and scored the same
way. A prompt no candidate holds is scored the same way too (the least work ahead, ties in its
rendezvous order); one that was not looked up at all is `prefix`'s pick: rendezvous hashing of
the prompt's start with bounded load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from extproc.policies.base import E, EndpointView, PickRequest, hrw_order, in_flight
from extproc.policies.prefix import PrefixPicker

__all__ = ["KvCacheOptions", "KvCachePicker", "work_ahead"]


class KvCacheOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # What a request in flight or queued costs beyond its tokens (a share of a step, the
    # scheduling, its KV push), in prompt tokens.
    kv_request_tokens: int = Field(default=64, ge=0)
    # What a cached token is worth in queued tokens: this request's wait, and the wait of
    # those queued after it where the prompt would be computed again.
    kv_cached_token_weight: float = Field(default=2.0, ge=0)
    # Where the prompts are not tokenized (no tokenizer, no kv_events): count what this sidecar
    # sent each engine, by the prompt's raw bytes (extproc.kvcache.routed_bytes); false: hash
    # the prompt's start, as `prefix` does.
    kv_approximate: bool = True


def work_ahead(endpoint: EndpointView, request_tokens: int) -> float:
    """The work queued at `endpoint` ahead of a new request, in prompt tokens: this sidecar's
    (every ext_proc process's) and, per request, other routers'."""
    requests = endpoint.in_flight + endpoint.peer_in_flight + endpoint.foreign
    return endpoint.pending_tokens + endpoint.peer_pending_tokens + requests * request_tokens


class KvCachePicker:
    def __init__(self, options: KvCacheOptions | None = None) -> None:
        options = options or KvCacheOptions()
        self._request_tokens = options.kv_request_tokens
        self._weight = options.kv_cached_token_weight
        self._fallback = PrefixPicker()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        cached = request.cached
        if cached is None or request.prompt_tokens <= 0:  # not looked up: nothing to weigh
            return self._fallback.pick(candidates, request)
        # Held nowhere (a new prompt) still goes where the least work waits: `prefix`'s bound
        # on in-flight counts let one engine take half again its share of a burst of new
        # conversations, whose queue was the TTFT tail (docs/lab.md, "The multi-turn tail").
        order = hrw_order(request.prefix, candidates)
        rank = {id(c): i for i, c in enumerate(order)}
        ahead = {id(c): work_ahead(c, self._request_tokens) for c in candidates}
        anyone_idle = 0 in ahead.values()
        return max(
            candidates,
            key=lambda c: (
                self._score(
                    c,
                    request,
                    min(cached.get(c.address, 0), request.prompt_tokens),
                    ahead[id(c)],
                    anyone_idle,
                ),
                -rank[id(c)],
            ),
        )

    def _score(
        self,
        candidate: EndpointView,
        request: PickRequest,
        cached: int,
        ahead: float,
        anyone_idle: bool,
    ) -> float:
        """What the candidate's cache saves, less the work `ahead` there. A cached token counts
        once for the requests after this one and once for this request's own wait, but on a
        light load (an engine idle, and at most the one request computing it in flight here)
        only the settled tokens count for this request: one still being computed saves it
        nothing an idle engine would not give it sooner, and no one queues behind a second
        copy there."""
        own = cached
        if anyone_idle and in_flight(candidate) <= 1:
            own = candidate.settled(request.prefix, cached)
        weight_own = min(self._weight, 1.0)
        return weight_own * own + (self._weight - weight_own) * cached - ahead

    def pick_rank(
        self, loads: Sequence[float], cached: Mapping[int, int], prompt_tokens: int
    ) -> int | None:
        """The rank of a data-parallel server (`loads[r]`: the requests queued at rank r)
        where the request is served soonest, counting what each rank holds; None where no
        rank holds any of the prompt (the least loaded one then, as without the index)."""
        if prompt_tokens <= 0 or not any(cached.get(r, 0) for r in range(len(loads))):
            return None
        return max(
            range(len(loads)),
            key=lambda r: (
                self._weight * min(cached.get(r, 0), prompt_tokens)
                - loads[r] * self._request_tokens,
                -loads[r],
                -r,
            ),
        )
