"""KV-cache routing's state in one process: the index, the engines' subscribers, the tokenizers.

The wiring says which engines publish where (`follow`, from the pools' membership and their
`kv_events`) and which tokenizer each model group has (`configure`); the request path asks for
a request's token ids (`tokenizer_for`: None where the group does not route by the KV cache, so
that such requests cost nothing) and what each engine holds of them (`lookup`).

A data-parallel server (vLLM's `--data-parallel-size N`) runs N engines, and each publishes its
own events, as vLLM does, on the pool's ports plus its rank: each rank is followed and indexed
as an engine of its own, `<address> dp<rank>` (named as its identity is), and a lookup gives
the server what its best rank holds, and per rank what each holds (the rank choice's).

A model group whose requests are not tokenized (no tokenizer, or no pool with `kv_events`) and
whose pools use `kv_cache` (with `kv_approximate`, the default) is routed by what this sidecar
sent where instead (`routed_bytes`: block chains over the prompt's raw bytes), for all its
engines: the index needs the prompt's token ids, so an engine's events cannot be used without
them, and within a tokenized group an engine not heard from is already estimated by the token
blocks routed to it (`routed`), in the same units as the index's.

Every lookup is in the request's cache scope (`extproc.kvcache.scope`: its LoRA adapter and
cache salt); which model names are base models, the engines tell (`learn_base_model`, from
their scraped metrics).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from extproc.config import Config, KvEventsConfig, PoolConfig, parse_host_port
from extproc.kvcache.index import KvIndex
from extproc.kvcache.routed import RoutedBlocks
from extproc.kvcache.routed_bytes import RoutedBytes
from extproc.kvcache.scope import PLAIN, CacheScope, request_scope
from extproc.kvcache.tokenize_pool import OffLoopTokenizer
from extproc.kvcache.tokens import TokenizerFilesError
from extproc.kvcache.watchers import EventSource, KvEventWatchers
from extproc.metrics import Metrics
from extproc.roles import Role
from extproc.stopping import cancel_and_wait

__all__ = [
    "Cached",
    "KvRouting",
    "TokenizerFactory",
    "approximated_groups",
    "event_sources",
    "kv_groups",
    "off_loop_tokenizer",
    "rank_engine",
]

log = logging.getLogger("extproc")

_FOLLOW_WAIT_S = 5.0  # the follower's wake-up when nothing changes (every wait has a timeout)
_ROUTED_BLOCKS = 65_536  # (engine, block) entries remembered for engines without events
# A P leg's prompt is remembered (`sent`) by its first 256 blocks (4096 tokens): its start is
# what draws it back to its P, and its keys cost the loop about 0.08 ms per 1000 tokens.
_SENT_BLOCKS = 256
_MAX_BASE_MODELS = 1024  # engines whose base model is kept: far more than any pool has
_MAX_SERVED_NAMES = 64  # of one engine's base-model names (its --served-model-name list)


def rank_engine(address: str, rank: int) -> str:
    """The index's name of one rank of a data-parallel server (its identity's name too)."""
    return f"{address} dp{rank}"


@dataclass(frozen=True, slots=True)
class Cached:
    """What the engines hold of one prompt, in leading tokens: per pool member (a
    data-parallel server: its best rank), and per rank of each data-parallel server heard
    from."""

    by_endpoint: dict[str, int] = field(default_factory=dict)
    by_rank: dict[str, dict[int, int]] = field(default_factory=dict)
    # where engines not heard from are estimated: by_endpoint counting, for those, only what
    # has reached them (the decision's D); None: by_endpoint is what they hold
    landed: dict[str, int] | None = None
    # where an engine heard from was sent more of the prompt than its events say it holds
    # (it evicted some): by_endpoint with that depth instead, the prefill pool's view of it
    # (PickRequest.sent_or_held); None: by_endpoint
    sent_or_held: dict[str, int] | None = None


# A model's tokenizer from its files' path, told why a request gets no ids (the lab gives one
# whose workers take simulated time)
TokenizerFactory = Callable[[str, Callable[[str], None]], OffLoopTokenizer]


def off_loop_tokenizer(path: str, on_unknown: Callable[[str], None]) -> OffLoopTokenizer:
    return OffLoopTokenizer(path, on_unknown=on_unknown)


class KvRouting:
    def __init__(
        self,
        index: KvIndex,
        metrics: Metrics,
        watchers: KvEventWatchers | None = None,
        tokenizers: TokenizerFactory = off_loop_tokenizer,
    ) -> None:
        self.index = index
        self._tokenizers = tokenizers
        self.watchers = watchers or KvEventWatchers(index, metrics)
        self.routed = RoutedBlocks(_ROUTED_BLOCKS)  # where prompts went, for silent engines
        self.sent = RoutedBlocks(_ROUTED_BLOCKS)  # what each P was sent (for sent_or_held)
        self.routed_bytes = RoutedBytes()  # where prompts went, for groups not tokenized
        self._approximated: frozenset[str] = frozenset()
        # the last prompt's keys: (its ids, its scope, the keys, whether all of them)
        self._last_keys: tuple[Sequence[int] | None, CacheScope, list[int], bool] = (
            None,
            PLAIN,
            [],
            True,
        )
        self._base_of: dict[str, str] = {}  # engine address → the base model it serves
        self._names_of: dict[str, frozenset[str]] = {}  # engine address → its base's names
        self._bases: frozenset[str] = frozenset()  # every name of a base model, for scope_of
        self._metrics = metrics
        self._by_path: dict[str, OffLoopTokenizer] = {}
        self._by_group: dict[str, OffLoopTokenizer] = {}
        self._warned: set[str] = set()
        self._context: dict[str, int] = {}  # model group → the longest prompt its engines run
        self._told: dict[str, int] = {}  # engine address → its context length, as it said
        self._wanted: dict[str, EventSource] = {}
        self._rank_of: dict[str, tuple[str, int]] = {}  # a rank's engine → (server, rank)
        self._ranks: dict[str, list[str]] = {}  # a data-parallel server → its ranks' engines
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- tokenizers ----------------------------------------------------------------------------

    def configure(
        self, groups: Mapping[str, tuple[bool, str | None]], approximate: Collection[str] = ()
    ) -> None:
        """`groups`: model group → (a pool of it has kv_events, its tokenizer path);
        `approximate`: the groups whose kv_cache pools may route by what was sent where. A
        group with events but no tokenizer cannot use them: one warning says so, and what
        it does instead."""
        by_group: dict[str, OffLoopTokenizer] = {}
        for group, (events, path) in groups.items():
            if not events:
                continue
            if path is None:
                self._warn_once(group, _no_tokenizer(group, group in approximate))
                continue
            tokenizer = self._load(path)
            if tokenizer is not None:
                by_group[group] = tokenizer
        self._by_group = by_group
        self._approximated = frozenset(g for g in approximate if g not in by_group)
        kept = set(by_group.values())
        for path, tokenizer in list(self._by_path.items()):
            if tokenizer not in kept:  # a reload left it: its worker processes end now
                del self._by_path[path]
                tokenizer.close()

    def _load(self, path: str) -> OffLoopTokenizer | None:
        if path not in self._by_path:
            try:
                self._by_path[path] = self._tokenizers(path, self._untokenized)
            except TokenizerFilesError as error:
                self._warn_once(path, f"KV-cache routing is off for {path}: {error}")
                return None
            if self._task is not None:  # started: a reload's new tokenizer
                self._by_path[path].warm()
        return self._by_path[path]

    def _untokenized(self, reason: str) -> None:
        self._metrics.kv_untokenized_requests.labels(reason=reason).inc()

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s", message)

    @property
    def routed_groups(self) -> set[str]:
        return set(self._by_group)

    def approximates(self, group: str) -> bool:
        """Model group `group` is routed by what was sent where (`routed_bytes`)."""
        return group in self._approximated

    def remember_bytes(self, engines: Sequence[str], keys: Sequence[int]) -> None:
        """A prompt of these `routed_bytes` keys was routed to `engines`."""
        self.routed_bytes.remember(engines, keys)

    def land(self, engine: str, keys: Sequence[int]) -> None:
        """The prompt of these keys (`routed_bytes`' or `routed`'s, as `sent_keys` gave) has
        reached `engine`: its request's KV is there."""
        self.routed_bytes.land(engine, keys)
        self.routed.land(engine, keys)

    def sent_keys(
        self, engine: str, token_ids: Sequence[int], scope: CacheScope = PLAIN
    ) -> list[int]:
        """The keys `remember` kept the prompt under for `engine` (none if heard from)."""
        return [] if self._heard_from(engine) else self._routed_keys(token_ids, scope)

    def tokenizer_for(self, group: str) -> OffLoopTokenizer | None:
        """The tokenizer of model group `group` if it routes by the KV cache, else None."""
        return self._by_group.get(group)

    def context_length(self, group: str, tokens: int) -> None:
        """An engine of `group` runs prompts of up to `tokens` tokens (its max_model_len)."""
        self._context[group] = max(tokens, self._context.get(group, 0))

    def context(self, group: str) -> int | None:
        """The longest prompt, in tokens, any engine of `group` said it runs; None while
        none has said."""
        return self._context.get(group)

    def engine_context(self, address: str, tokens: int | None) -> None:
        """The engine at `address` runs prompts of up to `tokens` tokens; None: not known (it
        did not say, or it went down or restarted and may say otherwise)."""
        if tokens is None:
            self._told.pop(address, None)
        else:
            self._told[address] = tokens

    def fit_limit(self, engines: Collection[str]) -> int | None:
        """The longest prompt, in tokens, any of `engines` runs, once every one of them has
        said its length; None while one has not (or there are none): then no prompt is
        known to fit none of them."""
        told = [self._told.get(engine) for engine in engines]
        if not told or None in told:
            return None
        return max(t for t in told if t is not None)

    @property
    def enabled(self) -> bool:
        return bool(self._by_group)

    def cached_tokens(self, token_ids: Sequence[int], scope: CacheScope = PLAIN) -> dict[str, int]:
        """Per pool member: how many leading tokens of `token_ids` it holds (`lookup`)."""
        return self.lookup(token_ids, scope).by_endpoint

    def lookup(self, token_ids: Sequence[int], scope: CacheScope = PLAIN) -> Cached:
        """Per engine: how many leading tokens of `token_ids` it holds in `scope`, by its
        events; for an engine not heard from, how many of them this sidecar routed to it in
        that scope (an estimate). A data-parallel server's ranks are folded into it (its
        best), and kept per rank. And per engine heard from that was sent more of the prompt
        than it holds: that depth (`Cached.sent_or_held`)."""
        found = self.index.cached_tokens(token_ids, scope)
        by_rank: dict[str, dict[int, int]] = {}
        if self._rank_of:
            for engine in [e for e in found if e in self._rank_of]:
                address, rank = self._rank_of[engine]
                tokens = found.pop(engine)
                by_rank.setdefault(address, {})[rank] = tokens
                found[address] = max(found.get(address, 0), tokens)
        if not self.routed and not self.sent:
            return Cached(found, by_rank)
        silent = self.routed.engines() - found.keys()
        keys = self._routed_keys(token_ids, scope, None if silent else _SENT_BLOCKS)
        sent = self.sent.held(keys[:_SENT_BLOCKS], self.sent.engines())
        evicted = {e: n for e, n in sent.items() if n > found.get(e, 0)}
        if not silent:
            return Cached(found, by_rank, sent_or_held=(found | evicted) if evicted else None)
        landed = found | self.routed.held(keys, silent, reached=True)
        estimated = found | self.routed.held(keys, silent)
        return Cached(estimated, by_rank, landed, (estimated | evicted) if evicted else None)

    def _routed_keys(
        self, token_ids: Sequence[int], scope: CacheScope, blocks: int | None = None
    ) -> list[int]:
        """The prompt's keys for `routed` (its first `blocks`: for `sent`), computed once
        for its lookup and its `remember`."""
        ids, held_scope, keys, whole = self._last_keys
        enough = whole or (blocks is not None and blocks <= len(keys))
        if ids is not token_ids or held_scope != scope or not enough:
            tokens = len(token_ids) if blocks is None else blocks * self.routed.block_size
            whole = len(token_ids) <= tokens
            keys = self.routed.keys(token_ids if whole else token_ids[:tokens], scope)
            self._last_keys = (token_ids, scope, keys, whole)
        return keys[:blocks]

    def remember(
        self,
        engines: Sequence[str],
        token_ids: Sequence[int],
        scope: CacheScope = PLAIN,
        prefill: str | None = None,
    ) -> None:
        """The prompt was routed to `engines` in `scope`: those not heard from probably hold
        it now. The P among them (`prefill`) was sent it (`Cached.sent_or_held`, once it is
        heard from)."""
        silent = [e for e in engines if not self._heard_from(e)]
        if silent:
            keys = self._routed_keys(token_ids, scope)
            for engine in silent:
                self.routed.remember(engine, keys)
        if prefill is not None:  # before its first events too: the opening burst's placement
            self.sent.remember(prefill, self._routed_keys(token_ids, scope, _SENT_BLOCKS))

    # -- cache scopes --------------------------------------------------------------------------

    def learn_base_model(self, address: str, model: str) -> None:
        """The engine at `address` serves `model` as its base model (not a LoRA adapter)."""
        if self._base_of.get(address) != model and self._room(self._base_of, address):
            self._base_of[address] = model
            self._gather_bases()

    def learn_base_names(self, address: str, names: Collection[str]) -> None:
        """Every name the engine at `address` serves its base model under (its
        `--served-model-name` list, from its /v1/models): the metrics name only the first,
        and vLLM keys a request for any of them as the base model's."""
        kept = frozenset(list(names)[:_MAX_SERVED_NAMES])
        if self._names_of.get(address) != kept and self._room(self._names_of, address):
            self._names_of[address] = kept
            self._gather_bases()

    @staticmethod
    def _room(table: Mapping[str, object], address: str) -> bool:
        return address in table or len(table) < _MAX_BASE_MODELS

    def _gather_bases(self) -> None:
        self._bases = frozenset(self._base_of.values()).union(*self._names_of.values())

    def scope_of(self, model: str, doc: Mapping[str, object]) -> CacheScope:
        """The cache scope of a request for `model` with body `doc`: keyed by its adapter
        unless `model` is a name of an engine's base model."""
        return request_scope(model, doc, self._bases)

    def _heard_from(self, address: str) -> bool:
        return any(self.index.heard_from(e) for e in self._ranks.get(address) or [address])

    def forget(self, engine: str) -> None:
        """The engine left its pool: what was routed to it no longer counts."""
        self.routed.forget(engine)
        self.sent.forget(engine)
        self.routed_bytes.forget(engine)
        self._base_of.pop(engine, None)
        self._told.pop(engine, None)
        self._names_of.pop(engine, None)
        self._gather_bases()

    # -- subscribers ---------------------------------------------------------------------------

    def follow(self, sources: Mapping[str, EventSource]) -> None:
        """Subscribe to exactly `sources` (engine → where it publishes), soon. An engine that
        leaves takes its entries out of the index at once."""
        for engine in set(self._wanted) - set(sources):
            self.index.remove_engine(engine)
        self._wanted = dict(sources)
        self._rank_of = {
            engine: (source.address, source.rank)
            for engine, source in sources.items()
            if source.address is not None and source.rank is not None
        }
        self._ranks = {}
        for engine, (address, _) in self._rank_of.items():
            self._ranks.setdefault(address, []).append(engine)
        self._changed.set()

    @property
    def watched(self) -> Collection[str]:
        """The pool members whose KV events are followed (a data-parallel server's ranks are
        followed under their own names)."""
        if not self._rank_of:
            return self._wanted.keys()
        ranks = self._rank_of
        return {ranks[e][0] if e in ranks else e for e in self._wanted}

    def engine_restarted(self, engine: str) -> None:
        """The engine's process changed (the restart detector): what it held is gone (every
        rank's, for a data-parallel server: one process)."""
        self.routed.forget(engine)
        self.sent.forget(engine)
        self.routed_bytes.forget(engine)
        for each in [engine, *self._ranks.get(engine, ())]:
            if each in self._wanted:
                self.index.clear_engine(each)
                self._metrics.kv_index_resets.labels(each, "restart").inc()
        self._metrics.kv_index_blocks.set(self.index.blocks)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name="kv-events follower")
            for tokenizer in self._by_path.values():
                tokenizer.warm()

    async def _follow(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), _FOLLOW_WAIT_S)
            except TimeoutError:
                continue
            self._changed.clear()
            await self.watchers.set_sources(self._wanted)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
        await self.watchers.stop()
        for tokenizer in self._by_path.values():
            tokenizer.close()
        self._by_path.clear()
        self._by_group = {}


def _name(group: str) -> str:
    return f"model {group}" if group else "the top-level pools"


def _no_tokenizer(group: str, approximated: bool) -> str:
    """What a group with kv_events but no tokenizer does, and how to route by its events."""
    instead = (
        "kv_cache routes by what this sidecar sent where (an estimate over the prompts' bytes)"
        if approximated
        else "it routes without the KV cache"
    )
    return (
        f"{_name(group)}: kv_events are set but no tokenizer, and the KV index needs the "
        f"prompts' token ids: {instead}. Set `tokenizer:` (the model's folder or "
        "tokenizer.json) to route by the engines' events"
    )


def approximated_groups(config: Config) -> set[str]:
    """The model groups with a kv_cache pool that may route by what was sent where
    (`kv_approximate`), for `KvRouting.configure`."""
    return {
        model
        for model, group in config.groups().items()
        if any(
            pool.policy == "kv_cache" and getattr(pool.options, "kv_approximate", False)
            for pool in (group.prefill, group.decode)
        )
    }


def kv_groups(config: Config) -> dict[str, tuple[bool, str | None]]:
    """Model group → (a pool of it has kv_events, its tokenizer), for `KvRouting.configure`."""
    return {
        model: (group.kv_events, config.tokenizer_of(model))
        for model, group in config.groups().items()
    }


def event_sources(
    config: Config,
    members: Mapping[str, Mapping[Role, Collection[str]]],
    routed: Collection[str],
    ranks_of: Callable[[Role, str], int] = lambda role, address: 1,
) -> dict[str, EventSource]:
    """Where every member of a pool with kv_events publishes: its host, the pool's ports (or
    its own, for a static endpoint that sets them); each rank of a data-parallel member
    (`ranks_of` > 1) on those ports plus its rank. `members`: model group → role → its
    current members; `routed`: the groups that route by the KV cache (a tokenizer)."""
    sources: dict[str, EventSource] = {}
    for model, group in config.groups().items():
        if model not in routed or model not in members:
            continue
        for role in Role:
            pool: PoolConfig = getattr(group, role)
            if pool.kv_events is None:
                continue
            for address in members[model].get(role, ()):
                source = _source(pool.kv_events, pool, address)
                if pool.kv_events.mode == "listen":
                    source = replace(source, endpoint="", topic="", address=address, model=model)
                ranks = ranks_of(role, address)
                if ranks <= 1:
                    sources[address] = source
                    continue
                for rank in range(ranks):
                    sources[rank_engine(address, rank)] = _of_rank(source, address, rank)
    return sources


def _of_rank(source: EventSource, address: str, rank: int) -> EventSource:
    """Rank `rank`'s sockets: vLLM adds the rank to each TCP port (it refuses an ipc endpoint
    with data parallelism; an inproc one never leaves its process)."""
    return replace(
        source,
        endpoint=_offset(source.endpoint, rank),
        replay_endpoint=None
        if source.replay_endpoint is None
        else _offset(source.replay_endpoint, rank),
        address=address,
        rank=rank,
    )


def _offset(endpoint: str, rank: int) -> str:
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        return endpoint
    return f"{base}:{int(port) + rank}"


def _source(events: KvEventsConfig, pool: PoolConfig, address: str) -> EventSource:
    port, replay = events.port, events.replay_port
    own = next((e.kv_events for e in pool.endpoints if e.address == address), None)
    if own is not None and own.endpoint is not None:
        return EventSource(own.endpoint, own.replay_endpoint, events.topic)
    if own is not None and own.port is not None:
        port, replay = own.port, own.replay_port
    host, _ = parse_host_port(address)
    host = f"[{host}]" if ":" in host else host
    return EventSource(
        f"tcp://{host}:{port}", None if replay is None else f"tcp://{host}:{replay}", events.topic
    )
