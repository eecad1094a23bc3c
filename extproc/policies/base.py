"""What every policy shares: the request it may look at, the endpoint state it reads, its shape.

`EndpointView` is the one description of an endpoint's load that the readers share: the
policies, the decode-only decision and admission control (`extproc.scheduling`). It is a
protocol over the pool's `EndpointState`, declared here, so that the pool depends on the
policies and never the other way round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

__all__ = ["EndpointView", "NoOptions", "PickRequest", "Picker", "hrw_order"]


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What a policy may look at; built once per request by the processor."""

    model: str = ""
    session: str | None = None  # the value of the configured session header, if sent
    prefix: bytes = field(default=b"", repr=False)  # the start of the raw prompt/messages JSON
    # The decode-only decision: the JSON bytes of what reaches the prompt, less what
    # `prompt_tokens` counts (extproc.request.prompt_size); None: a size the body cannot tell
    prompt_bytes: int | None = 0
    priority: int = 0  # admission control's priority (extproc.scheduling.admission)
    # KV-cache routing (only where a pool has kv_events and the model a tokenizer): the
    # prompt's token count, and per engine heard from, how many leading tokens it holds.
    prompt_tokens: int = 0
    cached: Mapping[str, int] | None = field(default=None, repr=False, compare=False)
    # per data-parallel server whose ranks publish events: rank → the leading tokens it holds
    rank_cached: Mapping[str, Mapping[int, int]] | None = field(
        default=None, repr=False, compare=False
    )
    # The approximate mode's (what was sent where): of `cached`, what has reached each
    # engine, which the decode-only decision counts as D's; None: `cached` is what they hold
    landed: Mapping[str, int] | None = field(default=None, repr=False, compare=False)
    # `cached` as the prefill pool scores it (`KvRouting.lookup`): an engine heard from is
    # credited with the prompt this sidecar sent it even where its events say it was evicted
    # since; None: `cached`
    sent_or_held: Mapping[str, int] | None = field(default=None, repr=False, compare=False)


class EndpointView(Protocol):
    """One endpoint's load, read-only (the pool owns the state; the P leg's client and the
    engine scraper update it)."""

    @property
    def address(self) -> str: ...
    @property
    def in_flight(self) -> int: ...  # requests this ext_proc has in flight there
    @property
    def queued_tokens(self) -> int: ...  # prefill: prompt tokens of our P legs in flight there
    @property
    def pending_tokens(self) -> int: ...  # KV routing: tokens it lacked, of our requests there
    @property
    def waiting(self) -> float: ...  # the engine's queue at the last scrape
    @property
    def running(self) -> float: ...  # the engine's batch at the last scrape
    @property
    def kv_usage(self) -> float: ...  # the engine's KV cache fill (0-1) at the last scrape
    @property
    def foreign(self) -> float: ...  # running + waiting beyond ours, at the last scrape
    # the sidecar's other ext_proc processes' counts there (0 with one process)
    @property
    def peer_in_flight(self) -> int: ...
    @property
    def peer_pending_tokens(self) -> int: ...
    @property
    def peer_queued_tokens(self) -> int: ...
    @property
    def peer_alone_tokens(self) -> int: ...  # decode: prompts they sent it to prefill alone
    # decode: the decision's stall bucket as the latest of them left it (at 0: none told)
    @property
    def peer_stall_credit_ms(self) -> float: ...
    @property
    def peer_stall_at(self) -> float: ...
    # KV-cache routing: of `cached` leading tokens of a prompt starting with `prefix`, those
    # not still being computed (or taken in) for one of our requests in flight there
    def settled(self, prefix: bytes, cached: int) -> int: ...


E = TypeVar("E", bound=EndpointView)


class Picker(Protocol):
    """One healthy endpoint of `candidates` (never empty: the pool filters unhealthy ones)."""

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E: ...


class NoOptions(BaseModel):
    """The options of a policy that has none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def in_flight(endpoint: EndpointView) -> int:
    """The requests this sidecar has in flight at `endpoint`: this process's and those of its
    other ext_proc processes (`extproc.scheduling.shared_load`)."""
    return endpoint.in_flight + endpoint.peer_in_flight


def hrw_order(key: bytes, candidates: Sequence[E]) -> list[E]:
    """Rendezvous (highest random weight) order of the candidates for `key`.

    Each (key, endpoint) pair gets an independent pseudo-random weight; the key belongs to
    the endpoint with the highest. Removing an endpoint moves only the keys it had (each to
    its own second choice, so they spread evenly); adding one takes ~1/n of every other's.
    The hash is blake2b, never Python's `hash()`: that one is salted per process, and
    stickiness must survive a restart of the sidecar and agree between replicas of it.
    """
    digest = hashlib.blake2b(key, digest_size=16).digest()
    return sorted(candidates, key=lambda c: _hrw_weight(digest, c.address), reverse=True)


def _hrw_weight(key: bytes, address: str) -> int:
    mixed = hashlib.blake2b(key + address.encode(), digest_size=8).digest()
    return int.from_bytes(mixed, "big")
