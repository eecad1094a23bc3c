"""Which way a request's two legs leave, decided from the mode and what is known of P.

| mode        | identity cached          | strategy | reason       |
|-------------|--------------------------|----------|--------------|
| pull        | any                      | serial   | pull         |
| serial_push | any                      | serial   | serial_only  |
| any         | endpoint is flapping     | serial   | serial_only  |
| auto, push  | no                       | serial   | cache_miss   |
| auto        | yes, transfer_mode≠push  | serial   | pull         |
| auto, push  | yes (push)               | parallel | cache_hit    |

Serial: wait for P, forward its kv_transfer_params verbatim to D (works for pull and push).
Parallel: D gets the cached identity while P computes; P's leg leaves first, D's a loop turn later.
Decode-only: D prefills the prompt itself, either by decision (`extproc.scheduling.decision`: the
reason says why) or because no P is healthy and `no_healthy_prefill: decode_only`
(reason `no_prefill`).

`plan_request` is the one call that plans a request: the scheduler's pick (`extproc.scheduling.
scheduler`), the strategy, the legs' bodies and their size check, in one of three plans that
also carry the request's in-flight counts; `extproc.request.strategies` has the class that runs
each. `plan_legs` is its pure part: bodies and destinations, without I/O.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from extproc.config import DispatchMode
from extproc.errors import ClientError
from extproc.kvcache.tokenize_pool import members_object
from extproc.policies import PickRequest
from extproc.protocol.bodies import (
    Member,
    Spliced,
    buffer_bytes,
    decode_body,
    prefill_body,
    prefill_kv_params,
)
from extproc.protocol.identity import PrefillIdentity
from extproc.request.approx_cache import approximate
from extproc.request.parse import Api, ClientRequest
from extproc.request.prompt_size import TOKENIZED, prompt_bytes
from extproc.scheduling.admission import request_priority
from extproc.scheduling.scheduler import DecodeAlone, WithPrefill

if TYPE_CHECKING:
    from extproc.config import Config
    from extproc.kvcache.routing import KvRouting
    from extproc.kvcache.scope import CacheScope
    from extproc.scheduling.pool import Counted
    from extproc.scheduling.scheduler import Scheduler
    from extproc.scheduling.subset_hint import Subset

__all__ = [
    "NOT_PLANNED",
    "DecodeOnlyPlan",
    "NoPlan",
    "ParallelPlan",
    "Plan",
    "SerialPlan",
    "Strategy",
    "check_fits",
    "check_plan_fits",
    "choose_strategy",
    "land_on_decode",
    "pick_request",
    "plan_legs",
    "plan_request",
    "request_tokens",
]

log = logging.getLogger("extproc")


class Strategy(StrEnum):
    PARALLEL = "parallel"
    SERIAL = "serial"
    DECODE_ONLY = "decode_only"  # by decision, or no healthy P (`no_healthy_prefill`)


def choose_strategy(
    mode: DispatchMode, identity: PrefillIdentity | None, serial_only: bool
) -> tuple[Strategy, str]:
    if mode is DispatchMode.PULL:
        return Strategy.SERIAL, "pull"
    if mode is DispatchMode.SERIAL_PUSH or serial_only:
        return Strategy.SERIAL, "serial_only"
    if identity is None:
        return Strategy.SERIAL, "cache_miss"
    if mode is DispatchMode.AUTO and identity.transfer_mode != "push":
        return Strategy.SERIAL, "pull"
    return Strategy.PARALLEL, "cache_hit"


class KnownIdentities(Protocol):
    """What planning reads of the identity cache."""

    def get(self, endpoint: str, rank: int | None = None) -> PrefillIdentity | None: ...
    def serial_only(self, endpoint: str, rank: int | None = None) -> bool: ...


@dataclass(frozen=True, slots=True)
class NoPlan:
    """A request with no legs to run: ended before it was planned (refused, or the client left),
    or passed through as it is (the endpoint picker's `passthrough`, counted at its D)."""

    strategy: Strategy = Strategy.SERIAL
    reason: str = "none"
    decode_counted: Counted | None = None
    request_id = ""
    prefill = None
    kv_keys = ()


NOT_PLANNED = NoPlan()


@dataclass(frozen=True, slots=True)
class DecodeOnlyPlan:
    request_id: str
    decodes: list[str]  # the choice, then Envoy's connect-failure fallbacks
    d_body: Spliced
    reason: str
    decode_counted: Counted | None  # the in-flight count at D, moved if another served
    decode_rank: int | None = None  # D's data-parallel rank (None: D has none)
    # The keys D is credited with the prompt under (estimated routing), to land once D answers
    kv_keys: Sequence[int] = ()
    prefill = None
    prefill_counted = None
    prefill_rank = None
    strategy = Strategy.DECODE_ONLY


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    request_id: str
    decodes: list[str]
    prefill: str
    p_body: Spliced
    d_body: Spliced  # carries `given`, P's cached identity
    given: PrefillIdentity
    reason: str
    decode_counted: Counted | None = None
    prefill_counted: Counted | None = None  # the count at P, which the P leg releases
    prefill_rank: int | None = None  # P's data-parallel rank, whose identity D got
    decode_rank: int | None = None
    kv_keys: Sequence[int] = ()
    strategy = Strategy.PARALLEL


@dataclass(frozen=True, slots=True)
class SerialPlan:
    request_id: str
    decodes: list[str]
    prefill: str
    p_body: Spliced  # D's body is built from P's answer
    parts: list[Member]  # the client body's members, for D's body
    reason: str
    fallback: str | None = None  # another P for one retry if `prefill` fails to answer
    decode_counted: Counted | None = None
    prefill_counted: Counted | None = None
    prefill_rank: int | None = None
    decode_rank: int | None = None
    kv_keys: Sequence[int] = ()
    strategy = Strategy.SERIAL


Plan = DecodeOnlyPlan | ParallelPlan | SerialPlan


_PREFIX_BYTES = 4096  # enough of the prompt for prefix-affinity policies to hash


def pick_request(
    request: ClientRequest,
    session: str | None,
    priority: int = 0,
    tokens: list[int] | None = None,
    kv: KvRouting | None = None,
    scope: CacheScope | None = None,
) -> PickRequest:
    """What the policies and the decision see of the request; with its `tokens`, what each
    engine holds of them in the request's cache scope (its LoRA adapter and cache salt: it is
    credited with no block stored under another), looked up now, just before the pick."""
    prompt = next((raw for key, raw in request.parts if key in ("prompt", "messages")), b"")
    prefix = bytes(prompt[:_PREFIX_BYTES])  # a key of its own, not a view into the body
    if tokens is None or kv is None:
        return PickRequest(request.model, session, prefix, prompt_bytes(request), priority)
    if scope is None:
        scope = kv.scope_of(request.model, request.doc)
    return PickRequest(
        request.model,
        session,
        prefix,
        prompt_bytes(request, TOKENIZED[request.api]),  # what the tokenizer did not count
        priority,
        len(tokens),
        (cached := kv.lookup(tokens, scope)).by_endpoint,
        cached.by_rank,
        cached.landed,
        cached.sent_or_held,
    )


async def request_tokens(request: ClientRequest, scheduler: Scheduler) -> list[int] | None:
    """The request's token ids as the engines compute them, where its model group routes by
    the KV cache; None otherwise (nothing is tokenized), or where they cannot be had (content
    that is not text, the tokenizer's queue full or its time up, a text longer than any engine
    of the group runs): routed without them. Token ids the vocabulary does not have: a
    ClientError (400)."""
    kv = scheduler.kv
    group = scheduler.group(request.model).name
    tokenizer = kv.tokenizer_for(group) if kv else None
    if tokenizer is None or kv is None:
        return None
    chat = request.api is Api.CHAT
    prompt = request.doc.get("prompt")
    if not chat:
        members = scheduler.group(request.model).members.values()
        _check_context(prompt, tokenizer.chars_per_token, kv.fit_limit(set().union(*members)))
    if not chat and isinstance(prompt, list):  # token ids (parse_request checked them)
        _check_vocabulary(prompt, tokenizer.vocab_size)
        return list(prompt)
    # a completion's text goes as it is (pickled once for a worker), not joined into JSON first
    job = prompt if isinstance(prompt, str) else members_object(request.parts, chat)
    return await tokenizer.ids(chat, request.doc, job, kv.context(group))


def _check_context(prompt: object, chars_per_token: int | None, limit: int | None) -> None:
    """A ClientError (400) for a prompt provably longer than `limit` tokens (the longest any
    engine of its group runs, once all have said): a text of n characters is at least
    n / `chars_per_token` tokens (None: the tokenizer gives no such bound), a list of ids is
    its length. Chat is not checked: a template may leave text out."""
    if limit is None:
        return
    if isinstance(prompt, list):
        least = len(prompt)
    elif isinstance(prompt, str) and chars_per_token is not None:
        least = -(-len(prompt) // chars_per_token)
    else:
        return
    if least > limit:
        raise ClientError(
            400,
            f"This model's maximum context length is {limit} tokens. However, the prompt is "
            f"at least {least} tokens; shorten the prompt",
            param="prompt",
        )


def _check_vocabulary(ids: list[int], vocab_size: int) -> None:
    largest = max(ids)  # in C: a long list costs the loop little
    if largest >= vocab_size:
        raise ClientError(
            400,
            f"'prompt' holds token id {largest}, outside the model's vocabulary "
            f"(ids 0 to {vocab_size - 1}); send ids the model's tokenizer gives",
            param="prompt",
        )


def plan_request(
    request: ClientRequest,
    headers: Mapping[str, str],
    config: Config,
    scheduler: Scheduler,
    identities: KnownIdentities,
    inflight: ExitStack,
    subset: Subset | None = None,
    fallbacks: int = 1,
    tokens: list[int] | None = None,
) -> Plan:
    """The whole plan of one request, under its config snapshot `config`: the endpoints (each
    counted in flight until `inflight` closes), decode-only or P/D, serial or parallel, the
    bodies, checked to fit Envoy's buffer before any leg leaves. `tokens`: `request_tokens`'s
    answer. Raises what the scheduler raises (Shed, NoHealthy*), ClientError for an
    oversized body."""
    priority = request_priority(headers, config.admission, scheduler.count_invalid_priority)
    kv, sent, scope = scheduler.kv, None, None
    approximated = (
        kv is not None and tokens is None and kv.approximates(scheduler.group(request.model).name)
    )
    if kv is not None and (tokens is not None or approximated):  # looked up: in its scope, once
        scope = kv.scope_of(request.model, request.doc)
    session = headers.get(config.dispatch.session_header)
    wanted = pick_request(request, session, priority, tokens, kv, scope)
    if approximated and kv is not None:  # not tokenized: what was sent where
        sent = approximate(request, wanted, kv, config.decision.bytes_per_token, scope)
        wanted = sent[0]
    picked = scheduler.pick(wanted, inflight, config, subset, fallbacks)
    landing: Sequence[int] = ()  # the keys its D is credited under, until D has it (`land`)
    if kv is not None and scope is not None:  # looked up: where its blocks went
        prefill = picked.prefill if isinstance(picked, WithPrefill) else None
        engines = [picked.decodes[0]] if prefill is None else [prefill, picked.decodes[0]]
        if sent is not None:
            kv.remember_bytes(engines, sent[1])
            landing = sent[1]
        else:
            kv.remember(engines, tokens or [], scope, prefill)
            landing = kv.sent_keys(picked.decodes[0], tokens or [], scope)
    request_id = str(uuid.uuid4())
    if isinstance(picked, DecodeAlone):
        d_body = decode_body(request.parts, None)  # the client's own, minus fields: it fits
        return DecodeOnlyPlan(
            request_id,
            picked.decodes,
            d_body,
            picked.reason,
            picked.decode_counted,
            picked.decode_counted.rank,
            landing,
        )
    prefill, rank = picked.prefill, picked.prefill_counted.rank
    identity = identities.get(prefill, rank)  # the chosen rank's: D registers with that engine
    choice = choose_strategy(
        scheduler.prefill_mode(prefill), identity, identities.serial_only(prefill, rank)
    )
    plan = plan_legs(request, request_id, picked, choice, identity)
    if landing:
        plan = replace(plan, kv_keys=landing)
    check_plan_fits(plan, config.limits.max_body_bytes)
    return plan


def plan_legs(
    request: ClientRequest,
    request_id: str,
    picked: WithPrefill,
    choice: tuple[Strategy, str],
    identity: PrefillIdentity | None,
) -> ParallelPlan | SerialPlan:
    """The legs' bodies and destinations. `choice` is `choose_strategy`'s answer for
    `picked.prefill`; `picked.fallback`: a second P a serial plan may retry on.
    `check_plan_fits` checks the bodies' sizes."""
    strategy, reason = choice
    prefill = picked.prefill
    transfer_id = f"xfer-{request_id}"  # unique per request, one uuid4 fewer
    p_body = prefill_body(
        request.parts, request.has_max_completion_tokens, prefill_kv_params(transfer_id)
    )
    if strategy is Strategy.PARALLEL and identity is not None:
        d_body = decode_body(request.parts, identity.decode_params(request_id, transfer_id))
        return ParallelPlan(
            request_id,
            picked.decodes,
            prefill,
            p_body,
            d_body,
            identity,
            reason,
            picked.decode_counted,
            picked.prefill_counted,
            picked.prefill_counted.rank,
            picked.decode_counted.rank,
        )
    return SerialPlan(
        request_id,
        picked.decodes,
        prefill,
        p_body,
        request.parts,
        reason,
        picked.fallback,
        picked.decode_counted,
        picked.prefill_counted,
        picked.prefill_counted.rank,
        picked.decode_counted.rank,
    )


def land_on_decode(plan: Plan | NoPlan, kv: KvRouting | None, served: str | None = None) -> None:
    """D answered (a P/D plan's D only once P has): the prompt's KV is on D (`served`, if
    a fallback served it), or on its way, so what was sent there counts for the decode-only
    decision from now on."""
    if kv is not None and plan.kv_keys and not isinstance(plan, NoPlan):
        kv.land(served or plan.decodes[0], plan.kv_keys)


def check_plan_fits(plan: Plan, max_body_bytes: int) -> None:
    """ClientError (413) if a body the plan sends would not fit Envoy's buffer; called before
    any leg leaves. A decode-only body is the client's own, minus fields: it always fits."""
    match plan:
        case ParallelPlan():
            check_fits(max_body_bytes, plan.p_body, plan.d_body)
        case SerialPlan():
            check_fits(max_body_bytes, plan.p_body)  # D's body is checked once P answered
        case DecodeOnlyPlan():
            pass


def check_fits(max_body_bytes: int, *bodies: Spliced) -> None:
    """A body longer than Envoy's buffer would be refused there: refuse it before it leaves.

    Envoy's buffer leaves room for the splice (`buffer_bytes`), so only a serial D body
    with an unusually long list of P's KV blocks can get here.
    """
    limit = buffer_bytes(max_body_bytes)
    size = max(len(body) for body in bodies)
    if size > limit:
        raise ClientError(
            413,
            f"with its kv_transfer_params the body for an engine is {size} bytes, "
            f"over the proxy's buffer of {limit} bytes; send a shorter prompt",
        )
