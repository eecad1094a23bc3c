"""The KV event subscribers of a set of engines, kept in step with the pools' membership.

An engine that leaves takes its entries out of the index and its series out of the metrics; an
engine whose event endpoints change is subscribed to afresh (what it held is unknown again).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import zmq.asyncio

from extproc.kvcache.index import KvIndex
from extproc.kvcache.listener import EventListener, Listened
from extproc.kvcache.subscriber import EngineEvents, SubscriberLimits
from extproc.metrics import Metrics

__all__ = ["EventSource", "KvEventWatchers"]

log = logging.getLogger("extproc")


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where an engine publishes its KV events (vLLM's `--kv-events-config`). One rank of a
    data-parallel server publishes on sockets of its own: `rank` names it, `address` its
    server (the pool member)."""

    endpoint: str  # "" where the engine connects to the listener (`listen`)
    replay_endpoint: str | None = None
    topic: str = ""
    address: str | None = None  # set with `rank`, and where the engine connects
    rank: int | None = None
    model: str = ""  # where the engine connects: its model group


class KvEventWatchers:
    def __init__(
        self,
        index: KvIndex,
        metrics: Metrics,
        *,
        limits: SubscriberLimits | None = None,
        context: zmq.asyncio.Context | None = None,
        listener: EventListener | None = None,
    ) -> None:
        self.index = index
        self._metrics = metrics
        self._limits = limits
        self._context = context
        self.listener = listener  # for engines that connect to the sidecar
        self._watching: dict[str, tuple[EventSource, EngineEvents]] = {}
        self._listened: dict[str, EventSource] = {}
        self._gone: set[str] = set()  # the engines of the last sources: those not kept leave

    def sources(self) -> dict[str, EventSource]:
        return {engine: source for engine, (source, _) in self._watching.items()} | self._listened

    async def set_sources(self, sources: Mapping[str, EventSource]) -> None:
        """Watch exactly `sources` (engine → where it publishes)."""
        subscribed = {e: s for e, s in sources.items() if s.endpoint}
        listened = {e: s for e, s in sources.items() if not s.endpoint}
        for engine, (source, events) in list(self._watching.items()):
            if subscribed.get(engine) != source:
                await events.stop()
                del self._watching[engine]
        for engine in set(self._listened) - set(listened):
            del self._listened[engine]
        await self._listen(listened)
        for engine, source in subscribed.items():
            if engine not in self._watching:
                events = EngineEvents(
                    engine,
                    source.endpoint,
                    self.index,
                    self._metrics,
                    replay_endpoint=source.replay_endpoint,
                    topic=source.topic,
                    limits=self._limits,
                    context=self._context,
                )
                events.start()
                self._watching[engine] = (source, events)
        for engine in self._gone - set(sources):
            self.index.remove_engine(engine)
            self._metrics.forget_kv_engine(engine)
        self._gone = set(sources)
        self._metrics.kv_index_blocks.set(self.index.blocks)
        self._metrics.kv_index_bytes.set(self.index.bytes_estimate())

    async def _listen(self, sources: Mapping[str, EventSource]) -> None:
        if self.listener is None:
            if sources:
                log.warning(
                    "KV events: %d engines connect to the sidecar but no listener is set",
                    len(sources),
                )
            return
        self._listened = dict(sources)
        await self.listener.set_engines(
            {
                engine: Listened(
                    source.address or engine,
                    source.model,
                    source.rank or 0,
                    source.replay_endpoint,
                )
                for engine, source in sources.items()
            }
        )

    async def stop(self) -> None:
        await self.set_sources({})
        if self.listener is not None:
            await self.listener.stop()
