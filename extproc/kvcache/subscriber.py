"""One engine's KV events, subscribed to on the PUB socket it binds (vLLM's `--kv-events-config`
with a `tcp://*:port` endpoint) and fed to its `EngineStream` (sequence, gaps, replay, slices,
pacing: `extproc.kvcache.stream`).

ZMQ holds at most `receive_hwm` messages of at most `max_message_bytes` each for the engine (it
drops the rest, which shows up as a gap). Should the task ever fail, it is restarted after a
backoff, its engine's entries dropped.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from extproc.kvcache.index import KvIndex
from extproc.kvcache.stream import EngineStream, SubscriberLimits, supervised, zmq_socket
from extproc.metrics import Metrics
from extproc.stopping import cancel_and_wait

__all__ = ["EngineEvents", "SubscriberLimits"]


class EngineEvents:
    """Subscribes to one engine's KV events and keeps its entries in `index` current."""

    def __init__(
        self,
        engine: str,
        endpoint: str,
        index: KvIndex,
        metrics: Metrics,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        limits: SubscriberLimits | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._metrics = metrics
        self._limits = limits or SubscriberLimits()
        self._context = context or zmq.asyncio.Context.instance()
        self.stream = EngineStream(
            engine,
            index,
            metrics,
            replay_endpoint=replay_endpoint,
            limits=self._limits,
            context=self._context,
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def applied(self) -> asyncio.Event:
        """Set after each applied batch (tests and start-up wait)."""
        return self.stream.applied

    def start(self) -> None:
        if self._task is None:
            self.stream.start()
            self._task = asyncio.create_task(
                supervised(self.stream, self._run, self._metrics, self._limits),
                name=f"kv-events {self.engine}",
            )

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def _run(self) -> None:
        sub = zmq_socket(self._context, zmq.SUB, self._limits)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.endpoint)
        try:
            while True:
                if await sub.poll(timeout=int(self._limits.poll_s * 1000)):
                    await self.stream.on_message(await sub.recv_multipart())
        finally:
            sub.close(linger=0)
