"""SimServer: one simulated vLLM process (HTTP site, side channel, engine generation).

A "generation" is what a real process restart replaces: engine id, start time,
metrics, block pool, step loop and connector. The HTTP listener and the side-channel
port survive a simulated restart, as a restarted vLLM would bind the same ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllmsim.config import SimConfig
from vllmsim.engine import Engine
from vllmsim.kv_events import EventPublisher
from vllmsim.metrics import Metrics
from vllmsim.nixl.base import ConnectorBase
from vllmsim.nixl.params import Identity
from vllmsim.nixl.pull import PullConnector
from vllmsim.nixl.push import PushConnector
from vllmsim.nixl.side_channel import SideChannelServer
from vllmsim.tokens import TokenCounter

log = logging.getLogger(__name__)


@dataclass
class Generation:
    engine_id: str
    start_time: float
    metrics: Metrics
    engine: Engine
    connector: ConnectorBase | None
    loop_task: asyncio.Task[None]


SIM_KEY: web.AppKey[SimServer] = web.AppKey("sim")


def _bind_host(host: str) -> str:
    # "localhost" may resolve to ::1 as well, which would give two ephemeral ports.
    return "127.0.0.1" if host == "localhost" else host


class SimServer:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.faults = cfg.faults
        self.model = cfg.served_model_names[0]
        self.tokens = TokenCounter(cfg.tokenizer)
        self.records: list[dict[str, Any]] = []
        self.side = SideChannelServer(self._side_message)
        self.http_port = cfg.port
        self.gen: Generation | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._relisten: asyncio.Task[None] | None = None
        self.events: EventPublisher | None = None  # --kv-events-config

    @property
    def current(self) -> Generation:
        assert self.gen is not None, "server not started"
        return self.gen

    # -- life cycle ----------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        # handler_cancellation: a client disconnect cancels the handler, which aborts
        # the request and frees its blocks, as vLLM does.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        await self._listen(self.cfg.port)
        await self.side.start(_bind_host(self.cfg.side_channel_host), self.cfg.side_channel_port)
        if self.cfg.kv_events is not None and self.cfg.kv_events.enabled:
            self.events = EventPublisher(self.cfg.kv_events)
            self.events.start()
        self.gen = self._new_generation()

    async def stop(self) -> None:
        if self._relisten is not None:
            self._relisten.cancel()
        if self.gen is not None:
            await self._end_generation(self.gen)
        await self.side.stop()
        if self.events is not None:
            await self.events.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def restart(self, down_for_s: float = 0.0) -> None:
        """Simulated process restart: new identity, everything in flight is dropped."""
        if down_for_s > 0:
            await self.set_refuse(True, down_for_s)
        old = self.current
        if self.events is not None:  # a new process: sequence from 0, nothing to replay
            self.events.restart()
        self.gen = self._new_generation()
        await self._end_generation(old)
        log.info("simulated restart: engine_id %s -> %s", old.engine_id, self.gen.engine_id)

    def _new_generation(self) -> Generation:
        kv = self.cfg.kv
        engine_id = (kv.engine_id if kv and kv.engine_id else None) or str(uuid.uuid4())
        start = time.time()
        metrics = Metrics(self.model, start)
        engine = Engine(
            self.cfg.cost,
            metrics,
            engine_id,
            self.cfg.cache,
            self.events.publish if self.events is not None else None,
            self.tokens.output_ids,
        )
        connector: ConnectorBase | None = None
        if kv is not None:
            ident = Identity(engine_id, self.cfg.side_channel_host, self.side.port)
            cls = PushConnector if kv.transfer_mode == "push" else PullConnector
            connector = cls(engine, kv, ident, self.faults)
            engine.connector = connector
        task = asyncio.get_running_loop().create_task(engine.run(), name="engine-loop")
        return Generation(engine_id, start, metrics, engine, connector, task)

    async def _end_generation(self, gen: Generation) -> None:
        gen.engine.abort_all("engine restarted")
        gen.loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gen.loop_task
        if gen.connector is not None:
            await gen.connector.close()

    # -- refusing connections -------------------------------------------------------------
    async def _listen(self, port: int) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.cfg.host, port, reuse_address=True)
        await self._site.start()
        server = self._site._server  # aiohttp exposes no public accessor for the socket
        assert isinstance(server, asyncio.Server) and server.sockets
        self.http_port = int(server.sockets[0].getsockname()[1])

    async def set_refuse(self, refuse: bool, for_s: float | None = None) -> None:
        """Close the listening socket (connects are refused) or listen again."""
        if self._relisten is not None and self._relisten is not asyncio.current_task():
            self._relisten.cancel()
            self._relisten = None
        self.faults.refuse_connections = refuse
        if refuse and self._site is not None:
            await self._site.stop()
            self._site = None
            self._drop_connections()
            if for_s:
                self._relisten = asyncio.get_running_loop().create_task(self._relisten_after(for_s))
        elif not refuse and self._site is None:
            await self._listen(self.http_port)

    def _drop_connections(self) -> None:
        """A dead process also loses its open connections (clients' keep-alive pools).

        The connection carrying the admin request that asked for this is closed a moment
        later, so that its answer still goes out.
        """
        assert self._runner is not None and self._runner.server is not None
        loop = asyncio.get_running_loop()
        for handler in self._runner.server.connections:
            loop.call_later(0.05, handler.force_close)

    async def _relisten_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.set_refuse(False)

    # -- side channel -----------------------------------------------------------------------
    async def _side_message(self, msg: dict[str, Any]) -> dict[str, Any]:
        connector = self.current.connector
        if connector is None:
            return {"ok": False, "error": "no KV connector configured"}
        return await connector.handle(msg)

    # -- admin views ------------------------------------------------------------------------
    def kv_events_endpoints(self) -> dict[str, str | None]:
        """Where KV events go (the bound ports of port-0 endpoints)."""
        if self.events is None:
            return {}
        return {
            "kv_events_endpoint": self.events.endpoint,
            "kv_events_replay_endpoint": self.events.replay_endpoint,
        }

    def state(self) -> dict[str, Any]:
        gen, kv = self.current, self.cfg.kv
        engine = gen.engine
        return {
            "engine_id": gen.engine_id,
            "role": kv.role if kv else None,
            "connector": kv.connector if kv else None,
            "transfer_mode": kv.transfer_mode if kv else None,
            "http_port": self.http_port,
            "side_channel_port": self.side.port,
            "blocks_total": engine.pool.total,
            "blocks_used": engine.pool.used,
            "blocks_cached": engine.pool.cached_blocks,
            "block_size": engine.block_size,
            **self.kv_events_endpoints(),
            "leases": gen.connector.leases.blocks_held if gen.connector else 0,
            "running": len(engine.running),
            "waiting": engine.num_waiting,
            "process_start_time": gen.start_time,
        }
