"""Shared connector plumbing: identity, leases, owned tasks, side-channel dispatch.

Both connectors serve both sides, as in vLLM: the role does not decide who prefills;
`do_remote_decode` / `do_remote_prefill` in each request does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from vllmsim.config import Faults, KVTransferConfig
from vllmsim.cost_model import Link, message_seconds
from vllmsim.engine import Engine, SimRequest
from vllmsim.kv_cache import Lease, LeaseTable
from vllmsim.nixl.params import Identity

log = logging.getLogger(__name__)


class ConnectorBase:
    mode = "pull"

    def __init__(
        self, engine: Engine, kv: KVTransferConfig, ident: Identity, faults: Faults
    ) -> None:
        self.engine = engine
        self.kv = kv
        self.ident = ident
        self.faults = faults
        self.leases = LeaseTable(
            engine.pool, kv.lease_duration_s, self._on_lease_expired, engine.wake
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._recv_tasks: dict[SimRequest, asyncio.Task[None]] = {}
        self.nic = Link()  # what this engine serves (pull READs) and posts (push WRITEs)

    @property
    def latency_s(self) -> float:
        return message_seconds(self.engine.cost)

    @property
    def recompute_on_failure(self) -> bool:
        return self.kv.load_failure_policy == "recompute"

    # -- engine hooks ------------------------------------------------------------------
    def start_step(self) -> None:
        """A step starts: what the scheduler staged goes to the connector's threads."""

    def end_step(self) -> set[SimRequest]:
        """A step ends: the receives the engine's main thread now sees as done."""
        return set()

    def has_pending_work(self) -> bool:
        """Work that keeps the engine stepping with nothing to compute."""
        return False

    def start_recv(self, req: SimRequest) -> None:
        task = self.spawn(self._recv(req))
        self._recv_tasks[req] = task
        task.add_done_callback(lambda _t: self._recv_tasks.pop(req, None))

    def abort(self, req: SimRequest) -> None:
        task = self._recv_tasks.pop(req, None)
        if task is not None:
            task.cancel()

    async def _recv(self, req: SimRequest) -> None:
        raise NotImplementedError

    # -- side channel --------------------------------------------------------------------
    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("type")
        if kind == "handshake":
            return {"ok": True, "engine_id": self.ident.engine_id, "transfer_mode": self.mode}
        return {"ok": False, "error": f"unknown message type {kind!r}"}

    def transfer_block_ids(self, block_ids: list[int]) -> list[int]:
        """The block ids a transfer served by this engine really touches: as asked, unless a
        fault shifts them or leaves out the last ones."""
        shifted = [b + self.faults.kv_block_offset for b in block_ids]
        return shifted[: max(0, len(shifted) - self.faults.kv_truncate_blocks)]

    def engine_id_error(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        if msg.get("remote_engine_id") != self.ident.engine_id:
            return {
                "ok": False,
                "error": "Remote NIXL agent engine ID mismatch",
                "engine_id": self.ident.engine_id,
            }
        return None

    # -- leases and tasks ---------------------------------------------------------------
    def _on_lease_expired(self, lease: Lease) -> None:
        log.warning("Releasing expired KV blocks for request %s", lease.request_id)
        self.engine.metrics.lbl(self.engine.metrics.nixl_expired).inc()

    async def transfer(self, num_blocks: int) -> float:
        """One transfer through this engine's NIC, behind the bytes already on it; returns its
        duration from post to completion (what NIXL's transfer time measures)."""
        loop = asyncio.get_running_loop()
        seconds = self.nic.transfer(self.engine.cost, num_blocks, loop.time())
        await asyncio.sleep(seconds)
        self.record_transfer(num_blocks, seconds)
        return seconds

    def record_transfer(self, num_blocks: int, seconds: float) -> None:
        metrics = self.engine.metrics
        metrics.lbl(metrics.nixl_bytes).inc(num_blocks * self.engine.cost.block_bytes)
        metrics.lbl(metrics.nixl_xfer_time).observe(seconds)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Simulated restart or shutdown: cancel every task, drop every lease."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.leases.clear()
