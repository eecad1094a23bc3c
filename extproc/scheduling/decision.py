"""Per request: disaggregate, or let the decode engine prefill the prompt itself.

Disaggregation does not always pay: on idle engines the P leg, the KV transfer and D's own
first step cost more than they save, and a decode engine serving a short prompt alone answers
sooner. It pays when D is busy: a prefill on D delays the next token of every request D is
running by the prefill's compute time (the stall).

`decision.mode`:
  off         always disaggregate
  threshold   decode-only for prompts of at most `max_prompt_tokens` (estimated)
  load_aware  decode-only when the expected TTFT alone is lower than through P, D's KV cache
              is not nearly full, the stall fits D's budget, and the time it saves this
              request exceeds the time it costs the requests D is running (the stall, once
              per running request); disaggregate otherwise

The prompt's size is estimated from the JSON bytes of every member that reaches it
(`extproc.request.prompt_size`: messages or prompt, tools, documents, template kwargs, ...;
`bytes_per_token`, ~4 for English text with BPE tokenizers): no tokenizer runs on the request
path, and the decision only needs the size to within tens of percent. A prompt whose size the
body cannot tell (a client's chat template, multimodal content) is never decode-only.
The load of both sides comes from this ext_proc's own counts (exact and instantaneous:
requests in flight per D, prompt tokens of P legs in flight per P, kept on the pool's endpoint
state by the P leg's client) and the engines' scraped metrics (queue, running requests, KV
usage; up to one scrape old). The step cost they imply is the
engines' step model (`decision.step_*`):
step = base + prefill tokens × per_token + running sequences × per_seq.

The stall budget is kept per decode engine as a bucket of milliseconds: it refills at
`stall_budget_ms_per_token` per output token of D's running requests (one token per decode
step), holds at most `max_stall_ms`, and each decode-only prefill on a D with running requests
spends its stall. An idle D has nothing to stall.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from extproc.config import DecisionConfig, DecisionMode
from extproc.policies.base import EndpointView

if TYPE_CHECKING:
    from extproc.metrics import Metrics

__all__ = [
    "Decider",
    "Decision",
    "decide",
    "estimate_tokens",
]

DISAGGREGATE = "disaggregate"
DECODE_ONLY = "decode_only"
UNBOUNDED = "unbounded_prompt"  # the body cannot tell the prompt's size: disaggregate


def estimate_tokens(prompt_bytes: int, bytes_per_token: float) -> int:
    return math.ceil(prompt_bytes / bytes_per_token)


@dataclass(frozen=True, slots=True)
class Decision:
    decode_only: bool
    reason: str
    ttft_alone_ms: float = 0.0
    ttft_pd_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Sides:
    """The load of the chosen D and P, as the decision sees it."""

    running_d: float  # requests D is running (this one not counted)
    waiting_d: float
    kv_usage_d: float
    pending_d_tokens: int  # decode-only prompts sent to D that may not be prefilled yet
    queued_p_tokens: int  # prompt tokens of P legs in flight to P
    waiting_p: float  # requests queued at P beyond this sidecar's P legs


def prefill_ms(cfg: DecisionConfig, tokens: int) -> float:
    """Compute time of `tokens` prompt tokens, in steps of at most max_batched_tokens."""
    steps = max(1, math.ceil(tokens / cfg.max_batched_tokens))
    return steps * cfg.step_base_ms + tokens * cfg.prefill_per_token_ms


def stall_ms(cfg: DecisionConfig, tokens: int, running_d: float) -> float:
    """How much a prefill of `tokens` on D delays its running requests' tokens."""
    if running_d <= 0:
        return 0.0
    extra_steps = max(0, math.ceil(tokens / cfg.max_batched_tokens) - 1)
    return tokens * cfg.prefill_per_token_ms + extra_steps * cfg.step_base_ms


def decide(
    cfg: DecisionConfig,
    tokens: int,
    sides: Sides,
    stall_credit_ms: float,
    d_cached: int = 0,
    p_cached: int = 0,
) -> Decision:
    """The decision for a prompt of `tokens` (estimated, or counted by the tokenizer), of which
    D already holds the first `d_cached` and P the first `p_cached` (KV-cache routing; neither
    is computed again); pure."""
    tokens_d = max(0, tokens - d_cached)  # what D computes alone
    if cfg.mode is DecisionMode.THRESHOLD:
        short = tokens_d <= cfg.max_prompt_tokens
        return Decision(short, "short_prompt" if short else "long_prompt")
    tokens_p = max(0, tokens - p_cached)
    decode_step = cfg.decode_per_seq_ms * sides.running_d
    alone = (
        sides.waiting_d * cfg.step_base_ms
        + prefill_ms(cfg, sides.pending_d_tokens + tokens_d)
        + decode_step
    )
    p_tokens = sides.queued_p_tokens + round(sides.waiting_p * tokens) + tokens_p
    pd = prefill_ms(cfg, p_tokens) + cfg.pd_overhead_ms + decode_step
    if sides.kv_usage_d >= cfg.max_kv_usage:
        return Decision(False, "kv_pressure", alone, pd)
    if alone >= pd:
        return Decision(False, "faster_pd", alone, pd)
    stall = stall_ms(cfg, tokens_d, sides.running_d)
    if stall > cfg.max_stall_ms or stall > stall_credit_ms:
        return Decision(False, "stall_budget", alone, pd)
    # Every request D is running waits out the stall once: a busy batch pays more in all
    # than this request saves (a short P path: P holds the prompt too, or is idle).
    if stall * sides.running_d >= pd - alone:
        return Decision(False, "decode_busy", alone, pd)
    return Decision(True, "faster_alone", alone, pd)


@dataclass(slots=True)
class _DecodeState:
    credit_ms: float  # the stall bucket
    updated: float  # the decider's clock, seconds
    pending: list[tuple[float, int]] = field(default_factory=list)  # (expires, tokens)


class Decider:
    """The decision's state: per-D stall buckets and pending prompts. `clock`: seconds, for
    the buckets' refill and the pending prompts' expiry (the lab's is its simulated time)."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self._decodes: dict[str, _DecodeState] = {}

    def decide(
        self,
        cfg: DecisionConfig,
        prompt_bytes: int | None,
        decode: str,
        d: EndpointView,
        p: EndpointView,
        prompt_tokens: int = 0,
        d_cached: int = 0,
        p_cached: int = 0,
    ) -> Decision:
        """Decode-only or not, for a request already counted in flight on `decode`; `cfg`:
        the request's config snapshot. `prompt_tokens`: the count, where the request was
        tokenized; `prompt_bytes`: the prompt's members it did not count (all of them when it
        is 0), estimated from their bytes, or None when no size can be told; `d_cached`/
        `p_cached`: its leading tokens D and P hold (KV-cache routing)."""
        if prompt_bytes is None:
            return self._count(Decision(False, UNBOUNDED))
        now = self._clock()
        tokens = prompt_tokens + estimate_tokens(prompt_bytes, cfg.bytes_per_token)
        # Ours exactly (this request not counted), plus what others sent as of the last scrape:
        # the scrape alone is up to an interval old, and a request ends in less.
        running_d = max(0.0, d.in_flight + d.peer_in_flight - 1 + d.foreign)
        state = self._decode_state(decode, cfg, running_d, now, d)
        sides = Sides(
            running_d,
            d.waiting,
            d.kv_usage,
            sum(t for _, t in state.pending) + d.peer_alone_tokens,
            p.queued_tokens + p.peer_queued_tokens,
            p.foreign,
        )
        decision = decide(cfg, tokens, sides, state.credit_ms, d_cached, p_cached)
        if decision.decode_only:
            uncached = max(0, tokens - d_cached)
            state.credit_ms -= stall_ms(cfg, uncached, running_d)
            state.pending.append((now + decision.ttft_alone_ms / 1e3, uncached))
        return self._count(decision)

    def _count(self, decision: Decision) -> Decision:
        self._metrics.decisions.labels(
            DECODE_ONLY if decision.decode_only else DISAGGREGATE, decision.reason
        ).inc()
        return decision

    def _decode_state(
        self, decode: str, cfg: DecisionConfig, running_d: float, now: float, d: EndpointView
    ) -> _DecodeState:
        state = self._decodes.get(decode)
        fresh = state is None
        if state is None:
            state = self._decodes[decode] = _DecodeState(cfg.max_stall_ms, now)
        # One bucket per D for the sidecar: where another process left it later than this
        # one, carry on from there (its spending included).
        if d.peer_stall_at and (fresh or d.peer_stall_at > state.updated):
            state.credit_ms, state.updated = d.peer_stall_credit_ms, d.peer_stall_at
        step_ms = max(cfg.step_base_ms + cfg.decode_per_seq_ms * running_d, 1e-3)
        elapsed = max(0.0, now - state.updated)
        refill = elapsed * 1e3 / step_ms * cfg.stall_budget_ms_per_token
        state.credit_ms = min(cfg.max_stall_ms, state.credit_ms + refill)
        state.updated = now
        state.pending = [(t, n) for t, n in state.pending if t > now]
        return state

    def alone(self, decode: str) -> tuple[int, float]:
        """The prompts this decider sent `decode` to prefill alone that may not be prefilled
        yet: their tokens, and when the last of them is due (the decider's clock)."""
        state = self._decodes.get(decode)
        if state is None or not state.pending:
            return 0, 0.0
        return sum(t for _, t in state.pending), max(t for t, _ in state.pending)

    def bucket(self, decode: str) -> tuple[float, float]:
        """`decode`'s stall bucket: its credit (ms) and when (the decider's clock; 0: none)."""
        state = self._decodes.get(decode)
        return (0.0, 0.0) if state is None else (state.credit_ms, state.updated)

    def forget(self, address: str) -> None:
        """The endpoint left its pool."""
        self._decodes.pop(address, None)
