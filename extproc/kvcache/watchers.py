"""The KV event subscribers of a set of engines, kept in step with the pools' membership.

An engine that leaves takes its entries out of the index and its series out of the metrics; an
engine whose event endpoints change is subscribed to afresh (what it held is unknown again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import zmq.asyncio

from extproc.kvcache.index import KvIndex
from extproc.kvcache.subscriber import EngineEvents, SubscriberLimits
from extproc.metrics import Metrics

__all__ = ["EventSource", "KvEventWatchers"]


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where an engine publishes its KV events (vLLM's `--kv-events-config`). One rank of a
    data-parallel server publishes on sockets of its own: `rank` names it, `address` its
    server (the pool member)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    address: str | None = None  # set with `rank`
    rank: int | None = None


class KvEventWatchers:
    def __init__(
        self,
        index: KvIndex,
        metrics: Metrics,
        *,
        limits: SubscriberLimits | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self._metrics = metrics
        self._limits = limits
        self._context = context
        self._watching: dict[str, tuple[EventSource, EngineEvents]] = {}

    def sources(self) -> dict[str, EventSource]:
        return {engine: source for engine, (source, _) in self._watching.items()}

    async def set_sources(self, sources: Mapping[str, EventSource]) -> None:
        """Watch exactly `sources` (engine → where it publishes)."""
        for engine, (source, events) in list(self._watching.items()):
            if sources.get(engine) != source:
                await events.stop()
                del self._watching[engine]
                if engine not in sources:
                    self.index.remove_engine(engine)
                    self._metrics.forget_kv_engine(engine)
        for engine, source in sources.items():
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
        self._metrics.kv_index_blocks.set(self.index.blocks)
        self._metrics.kv_index_bytes.set(self.index.bytes_estimate())

    async def stop(self) -> None:
        await self.set_sources({})
