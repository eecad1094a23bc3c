"""KV-cache routing's state in one process: the index, the engines' subscribers, the tokenizers.

The wiring says which engines publish where (`follow`, from the pools' membership and their
`kv_events`) and which tokenizer each model group has (`configure`); the request path asks for
a request's token ids (`tokenizer_for`: None where the group does not route by the KV cache, so
that such requests cost nothing) and what each engine holds of them (`cached_tokens`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence

from extproc.config import Config, KvEventsConfig, PoolConfig, parse_host_port
from extproc.kvcache.index import KvIndex
from extproc.kvcache.tokens import OffLoopTokenizer, RequestTokenizer, TokenizerFilesError
from extproc.kvcache.watchers import EventSource, KvEventWatchers
from extproc.metrics import Metrics
from extproc.roles import Role
from extproc.stopping import cancel_and_wait

__all__ = ["KvRouting", "event_sources", "kv_groups"]

log = logging.getLogger("extproc")

_FOLLOW_WAIT_S = 5.0  # the follower's wake-up when nothing changes (every wait has a timeout)


class KvRouting:
    def __init__(self, index: KvIndex, metrics: Metrics,
                 watchers: KvEventWatchers | None = None) -> None:  # fmt: skip
        self.index = index
        self.watchers = watchers or KvEventWatchers(index, metrics)
        self._metrics = metrics
        self._by_path: dict[str, OffLoopTokenizer] = {}
        self._by_group: dict[str, OffLoopTokenizer] = {}
        self._warned: set[str] = set()
        self._wanted: dict[str, EventSource] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- tokenizers ----------------------------------------------------------------------------

    def configure(self, groups: Mapping[str, tuple[bool, str | None]]) -> None:
        """`groups`: model group → (a pool of it has kv_events, its tokenizer path). A group
        with events but no tokenizer does not route by the KV cache: one warning says so."""
        by_group: dict[str, OffLoopTokenizer] = {}
        for group, (events, path) in groups.items():
            if not events:
                continue
            if path is None:
                self._warn_once(group, f"{_name(group)}: kv_events are set but no tokenizer; "
                                       "it routes without the KV cache. Set `tokenizer:` (the "
                                       "model's folder or tokenizer.json)")  # fmt: skip
                continue
            tokenizer = self._load(path)
            if tokenizer is not None:
                by_group[group] = tokenizer
        self._by_group = by_group

    def _load(self, path: str) -> OffLoopTokenizer | None:
        if path not in self._by_path:
            try:
                self._by_path[path] = OffLoopTokenizer(RequestTokenizer.from_path(path))
            except TokenizerFilesError as error:
                self._warn_once(path, f"KV-cache routing is off for {path}: {error}")
                return None
        return self._by_path[path]

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s", message)

    @property
    def routed_groups(self) -> set[str]:
        return set(self._by_group)

    def tokenizer_for(self, group: str) -> OffLoopTokenizer | None:
        """The tokenizer of model group `group` if it routes by the KV cache, else None."""
        return self._by_group.get(group)

    @property
    def enabled(self) -> bool:
        return bool(self._by_group)

    def cached_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Per engine heard from: how many leading tokens of `token_ids` it holds."""
        return self.index.cached_tokens(token_ids)

    # -- subscribers ---------------------------------------------------------------------------

    def follow(self, sources: Mapping[str, EventSource]) -> None:
        """Subscribe to exactly `sources` (engine → where it publishes), soon. An engine that
        leaves takes its entries out of the index at once."""
        for engine in set(self._wanted) - set(sources):
            self.index.remove_engine(engine)
        self._wanted = dict(sources)
        self._changed.set()

    @property
    def watched(self) -> Collection[str]:
        """The engines whose KV events are followed."""
        return self._wanted.keys()

    def engine_restarted(self, engine: str) -> None:
        """The engine's process changed (the restart detector): what it held is gone."""
        if engine in self._wanted:
            self.index.clear_engine(engine)
            self._metrics.kv_index_resets.labels(engine, "restart").inc()
            self._metrics.kv_index_blocks.set(self.index.blocks)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name="kv-events follower")

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


def kv_groups(config: Config) -> dict[str, tuple[bool, str | None]]:
    """Model group → (a pool of it has kv_events, its tokenizer), for `KvRouting.configure`."""
    return {model: (group.kv_events, config.tokenizer_of(model))
            for model, group in config.groups().items()}  # fmt: skip


def event_sources(
    config: Config, members: Mapping[str, Mapping[Role, Collection[str]]],
    routed: Collection[str],
) -> dict[str, EventSource]:
    """Where every member of a pool with kv_events publishes: its host, the pool's ports (or
    its own, for a static endpoint that sets them). `members`: model group → role → its
    current members; `routed`: the groups that route by the KV cache (a tokenizer)."""
    sources: dict[str, EventSource] = {}
    for model, group in config.groups().items():
        if model not in routed or model not in members:
            continue
        for role in Role:
            pool: PoolConfig = getattr(group, role)
            if pool.kv_events is not None:
                for address in members[model].get(role, ()):
                    sources[address] = _source(pool.kv_events, pool, address)
    return sources


def _source(events: KvEventsConfig, pool: PoolConfig, address: str) -> EventSource:
    port, replay = events.port, events.replay_port
    own = next((e.kv_events for e in pool.endpoints if e.address == address), None)
    if own is not None and own.endpoint is not None:
        return EventSource(own.endpoint, own.replay_endpoint, events.topic)
    if own is not None and own.port is not None:
        port, replay = own.port, own.replay_port
    host, _ = parse_host_port(address)
    host = f"[{host}]" if ":" in host else host
    return EventSource(f"tcp://{host}:{port}",
                       None if replay is None else f"tcp://{host}:{replay}", events.topic)
