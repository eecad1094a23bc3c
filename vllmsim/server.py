"""SimServer: one simulated vLLM process (HTTP site; per engine rank a side channel and an
engine generation).

A "generation" is what a real process restart replaces: engine id, start time,
metrics, block pool, step loop and connector. The HTTP listener and the side-channel
port survive a simulated restart, as a restarted vLLM would bind the same ports.

With `--data-parallel-size N` one API server fronts N engine ranks, as vLLM's internal load
balancing does: rank r has the engine id `<engine_id>_dp<r>`, the side channel
`VLLM_NIXL_SIDE_CHANNEL_PORT + r` and the metrics label `engine="<r>"`; a request goes to the
rank its `X-data-parallel-rank` header names, else to the least loaded one. One rank can be
restarted alone (`POST /sim/restart {"rank": r}`), a simulator-only fault: real vLLM fails the
whole server when one engine dies.
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
from vllmsim.cost_model import ApiProcess
from vllmsim.engine import Engine, StepLateness
from vllmsim.kv_events import EventPublisher, rank_publishers
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


class Rank:
    """One data-parallel engine rank: its side channel and its current generation."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.side = SideChannelServer(self._side_message)
        self.gen: Generation | None = None
        self.in_flight = 0  # requests the API server sent here and that have not ended
        self.events: EventPublisher | None = None  # --kv-events-config: this rank's sockets

    @property
    def current(self) -> Generation:
        assert self.gen is not None, "server not started"
        return self.gen

    @property
    def load(self) -> int:
        """vLLM's balancing score: the greater of its own in-flight count and the engine's
        waiting + running requests."""
        engine = self.current.engine
        return max(self.in_flight, engine.num_waiting + len(engine.running))

    async def _side_message(self, msg: dict[str, Any]) -> dict[str, Any]:
        connector = self.current.connector
        if connector is None:
            return {"ok": False, "error": "no KV connector configured"}
        return await connector.handle(msg)

    def view(self) -> dict[str, Any]:
        gen = self.current
        return {
            "rank": self.index,
            "engine_id": gen.engine_id,
            "side_channel_port": self.side.port,
            "running": len(gen.engine.running),
            "waiting": gen.engine.num_waiting,
            "in_flight": self.in_flight,
            **kv_events_endpoints(self.events),
        }


def kv_events_endpoints(events: EventPublisher | None) -> dict[str, str | None]:
    """Where one rank's KV events go (the bound ports of port-0 endpoints)."""
    if events is None:
        return {}
    return {
        "kv_events_endpoint": events.endpoint,
        "kv_events_replay_endpoint": events.replay_endpoint,
    }


class SimServer:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.faults = cfg.faults
        self.model = cfg.served_model_names[0]
        self.tokens = TokenCounter(cfg.tokenizer)
        self.records: list[dict[str, Any]] = []
        self.ranks = [Rank(r) for r in range(cfg.data_parallel_size)]
        self._next_rank = 0  # where the balancing scan starts: ties rotate, as in vLLM
        self.http_port = cfg.port
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._relisten: asyncio.Task[None] | None = None
        self.api = ApiProcess()  # the one API server process in front of every rank

    @property
    def current(self) -> Generation:
        """Rank 0's generation (the only one without data parallelism)."""
        return self.ranks[0].current

    @property
    def side(self) -> SideChannelServer:
        return self.ranks[0].side

    @property
    def data_parallel(self) -> bool:
        return len(self.ranks) > 1

    def balance(self) -> Rank:
        """The least loaded rank, the scan starting one further each time (vLLM's DP
        load balancer without its coordinator's 100 ms snapshots)."""
        n = len(self.ranks)
        order = [self.ranks[(self._next_rank + i) % n] for i in range(n)]
        self._next_rank = (self._next_rank + 1) % n
        return min(order, key=lambda rank: rank.load)

    def rank_views(self) -> list[dict[str, Any]]:
        return [rank.view() for rank in self.ranks]

    # -- life cycle ----------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        # handler_cancellation: a client disconnect cancels the handler, which aborts
        # the request and frees its blocks, as vLLM does.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        await self._listen(self.cfg.port)
        base = self.cfg.side_channel_port
        for rank in self.ranks:  # vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT + the rank
            port = base + rank.index if base else 0
            await rank.side.start(_bind_host(self.cfg.side_channel_host), port)
        if self.cfg.kv_events is not None and self.cfg.kv_events.enabled:
            # vLLM: one publisher per rank's scheduler
            publishers = await rank_publishers(self.cfg.kv_events, len(self.ranks))
            for rank, events in zip(self.ranks, publishers, strict=True):
                rank.events = events
                events.start()
        self._start_generations()

    async def stop(self) -> None:
        if self._relisten is not None:
            self._relisten.cancel()
        for rank in self.ranks:
            if rank.gen is not None:
                await self._end_generation(rank.gen)
            await rank.side.stop()
            if rank.events is not None:
                await rank.events.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def restart(self, down_for_s: float = 0.0, rank: int | None = None) -> None:
        """Simulated process restart: new identity, everything in flight is dropped. With
        `rank`, only that engine rank restarts (new engine id, its requests dropped)."""
        if rank is not None:
            await self._restart_rank(self.ranks[rank], self._base_engine_id(), time.time())
            return
        if down_for_s > 0:
            await self.set_refuse(True, down_for_s)
        base, start = self._base_engine_id(), time.time()
        for each in self.ranks:
            await self._restart_rank(each, base, start)

    async def _restart_rank(self, rank: Rank, base_id: str, start: float) -> None:
        if rank.events is not None:  # a new engine: sequence from 0, nothing to replay
            rank.events.restart()
        old = rank.current
        rank.gen = self._new_generation(rank, base_id, start)
        await self._end_generation(old)
        log.info("simulated restart: engine_id %s -> %s", old.engine_id, rank.gen.engine_id)

    def _base_engine_id(self) -> str:
        """kv_transfer_config's engine_id, else a new uuid4 (vLLM's default, per process)."""
        kv = self.cfg.kv
        return (kv.engine_id if kv and kv.engine_id else None) or str(uuid.uuid4())

    def _start_generations(self) -> None:
        base, start = self._base_engine_id(), time.time()
        for rank in self.ranks:
            rank.gen = self._new_generation(rank, base, start)

    def _new_generation(self, rank: Rank, base_id: str, start: float) -> Generation:
        kv = self.cfg.kv
        # vLLM's engine core appends the rank to every DP engine's id (not without DP)
        engine_id = f"{base_id}_dp{rank.index}" if self.data_parallel else base_id
        metrics = Metrics(self.model, start, engine=str(rank.index))
        engine = Engine(
            self.cfg.cost,
            metrics,
            engine_id,
            self.cfg.cache,
            rank.events.publish if rank.events is not None else None,
            self.tokens.output_ids,
            self.api,
        )
        connector: ConnectorBase | None = None
        if kv is not None:
            ident = Identity(engine_id, self.cfg.side_channel_host, rank.side.port)
            cls = PushConnector if kv.transfer_mode == "push" else PullConnector
            connector = cls(engine, kv, ident, self.faults)
            engine.connector = connector
        task = asyncio.get_running_loop().create_task(
            engine.run(), name=f"engine-loop-{rank.index}"
        )
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

    # -- admin views ------------------------------------------------------------------------
    def kv_events_endpoints(self) -> dict[str, str | None]:
        """Where rank 0's KV events go (every rank's: `rank_views`)."""
        return kv_events_endpoints(self.ranks[0].events)

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
            "data_parallel_size": len(self.ranks),
            "ranks": self.rank_views(),
            # every rank's steps together: how late they ran against the cost model
            "step_lateness": self.step_lateness(),
        }

    def step_lateness(self) -> dict[str, Any]:
        total = StepLateness()
        for rank in self.ranks:
            one = rank.current.engine.lateness
            total.steps += one.steps
            total.planned_s += one.planned_s
            total.late_s += one.late_s
            total.buckets = [a + b for a, b in zip(total.buckets, one.buckets, strict=True)]
        return total.as_dict()
