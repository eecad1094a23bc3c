"""Push (WRITE) mode, after vLLM 0.33's NixlPushConnector.

D: when its blocks are allocated, D handshakes once per P engine (checking P's engine
   id), sends PUSH_REG, then waits in WAITING_FOR_REMOTE_KVS - with no timeout, as in
   vLLM - for the WRITE-completion notif.
P: after its 1-token step the blocks are leased; on P's *next* step they reach the
   writer, which polls every 1 ms while it holds finished blocks. It pairs a finished
   request with a registration by exact id, else by `transfer_id` when both carry one,
   else by base id (one `-<8hex>` suffix stripped). Whichever arrives second triggers
   the WRITE: scenario 1 ("parallel": D registered while P was still prefilling) or
   scenario 2 ("serial": P finished first).
The WRITE: P copies what its blocks hold into the block ids D registered, in order; the
write_done message stands in for the RDMA write and its completion notif at once, so it
carries the ids and the content. D stores it wherever those ids point, then decodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllmsim.cost_model import transfer_seconds
from vllmsim.engine import SimRequest
from vllmsim.kv_cache import Lease
from vllmsim.kv_content import from_wire, to_wire
from vllmsim.nixl import side_channel
from vllmsim.nixl.base import ConnectorBase
from vllmsim.nixl.params import (
    base_request_id,
    block_group,
    prefill_params,
    side_channel_address,
    transfer_id,
)

log = logging.getLogger(__name__)

WRITER_POLL_S = 0.001  # vLLM's _PUSH_WRITER_POLL_INTERVAL_MS


@dataclass(eq=False)
class Registration:
    msg: dict[str, Any]
    arrived_at: float = field(default_factory=time.monotonic)

    @property
    def request_id(self) -> str:
        return str(self.msg.get("request_id"))

    @property
    def transfer_id(self) -> str | None:
        return transfer_id(self.msg)


def _matches(lease: Lease, reg: Registration) -> bool:
    if lease.request_id == reg.request_id:
        return True
    if lease.transfer_id and reg.transfer_id:
        return lease.transfer_id == reg.transfer_id
    return base_request_id(lease.request_id) == base_request_id(reg.request_id)


class PushConnector(ConnectorBase):
    mode = "push"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staged: list[Lease] = []  # finished this step; writer sees them next step
        self._finished: dict[str, Lease] = {}
        self._regs: list[Registration] = []
        self._writer_wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._handshaken: set[tuple[str, int, str]] = set()
        self._waiters: dict[str, asyncio.Future[None]] = {}

    # -- P side --------------------------------------------------------------------------
    def request_finished(self, req: SimRequest) -> dict[str, Any] | None:
        lease = Lease(req.internal_id, list(req.blocks), req.prompt_tokens,
                      transfer_id(req.remote))  # fmt: skip
        self.leases.add(lease)
        self._staged.append(lease)
        return prefill_params(self.ident, self.mode, req.blocks, req.internal_id,
                              req.num_computed)  # fmt: skip

    def start_step(self) -> bool:
        """vLLM ships finished blocks to the writer in the next step's metadata."""
        if not self._staged:
            return False
        for lease in self._staged:
            if self.leases.get(lease.request_id) is lease:
                self._finished[lease.request_id] = lease
        self._staged.clear()
        self._ensure_writer()
        self._writer_wake.set()
        return True

    def _on_lease_expired(self, lease: Lease) -> None:
        self._finished.pop(lease.request_id, None)
        super()._on_lease_expired(lease)

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("type")
        if kind == "push_reg":
            return self._on_registration(msg)
        if kind == "write_done":
            return self._on_write_done(msg)
        return await super().handle(msg)

    def _on_registration(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.faults.drop_registrations:
            log.warning("fault: dropping PUSH_REG for %s", msg.get("request_id"))
            return {"ok": True}  # a NIXL notif has no delivery receipt either
        if (err := self.engine_id_error(msg)) is not None:
            return err
        self._regs.append(Registration(msg))
        self._ensure_writer()
        self._writer_wake.set()
        return {"ok": True}

    def _ensure_writer(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = self.spawn(self._writer_loop())

    async def _writer_loop(self) -> None:
        while True:
            self._match()
            if self._finished:
                await asyncio.sleep(WRITER_POLL_S)  # self-poll while blocks wait
            else:
                self._writer_wake.clear()
                await self._writer_wake.wait()

    def _match(self) -> None:
        for rid, lease in list(self._finished.items()):
            reg = next((r for r in self._regs if _matches(lease, r)), None)
            if reg is None:
                continue
            self._regs.remove(reg)
            del self._finished[rid]
            self.spawn(self._write(lease, reg))

    async def _write(self, lease: Lease, reg: Registration) -> None:
        scenario = "parallel" if reg.arrived_at < lease.finished_at else "serial"
        seconds = transfer_seconds(self.engine.cost, len(lease.blocks))
        await asyncio.sleep(seconds)  # the NIXL WRITE into D's blocks
        self.record_transfer(len(lease.blocks), seconds)
        blocks = to_wire(self.engine.pool.read(lease.blocks))
        self.leases.release(lease.request_id)
        d_blocks = block_group(reg.msg.get("local_block_ids")) or []
        targets = self.transfer_block_ids(d_blocks[: len(blocks)])
        notif = {"type": "write_done", "request_id": reg.request_id, "scenario": scenario,
                 "engine_id": self.ident.engine_id, "local_block_ids": [targets],
                 "blocks": blocks[: len(targets)]}  # fmt: skip
        try:
            await side_channel.request(str(reg.msg["decode_host"]), int(reg.msg["decode_port"]),
                                       notif, self.latency_s)  # fmt: skip
        except side_channel.SideChannelError as exc:
            log.error("WRITE notif to D failed for %s: %s", reg.request_id, exc)
            self.engine.metrics.lbl(self.engine.metrics.nixl_failed_notifs).inc()

    # -- D side --------------------------------------------------------------------------
    def _on_write_done(self, msg: dict[str, Any]) -> dict[str, Any]:
        fut = self._waiters.pop(str(msg.get("request_id")), None)
        if fut is None or fut.done():
            # The request is gone and its blocks may already serve another one: the
            # simulator drops the write (it frees an aborted request's blocks at once).
            return {"ok": False, "error": "unknown request"}
        origin = f"push-{msg.get('scenario', 'serial')}"
        received = from_wire(msg.get("blocks"), origin, str(msg.get("engine_id")))
        self.engine.pool.write(block_group(msg.get("local_block_ids")) or [], received)
        fut.set_result(None)
        return {"ok": True}

    def abort(self, req: SimRequest) -> None:
        fut = self._waiters.pop(req.internal_id, None)
        if fut is not None:
            fut.cancel()
        super().abort(req)

    async def _recv(self, req: SimRequest) -> None:
        p = req.remote or {}
        try:
            host, port = side_channel_address(p)
            await self._handshake(host, port, str(p["remote_engine_id"]))
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[req.internal_id] = fut
            reply = await side_channel.request(host, port, self._registration(req), self.latency_s)
            if not reply.get("ok"):
                raise side_channel.SideChannelError(str(reply.get("error")))
        except (side_channel.SideChannelError, ValueError) as exc:
            self._waiters.pop(req.internal_id, None)
            self.engine.kv_failed(req, f"push_reg failed: {exc}", self.recompute_on_failure)
            return
        await fut  # no server-side timeout, as in vLLM 0.33
        self.engine.kv_ready(req)

    async def _handshake(self, host: str, port: int, engine_id: str) -> None:
        """One-time D->P handshake per P engine; a different id is a failed recv."""
        if (host, port, engine_id) in self._handshaken:
            return
        reply = await side_channel.request(host, port, {"type": "handshake"}, self.latency_s)
        if reply.get("engine_id") != engine_id:
            raise side_channel.SideChannelError(
                f"Remote NIXL agent engine ID mismatch. Expected {engine_id},"
                f" received {reply.get('engine_id')}."
            )
        self._handshaken.add((host, port, engine_id))

    def _registration(self, req: SimRequest) -> dict[str, Any]:
        p = req.remote or {}
        msg: dict[str, Any] = {
            "type": "push_reg",
            "request_id": req.internal_id,
            "decode_engine_id": self.ident.engine_id,
            "decode_host": self.ident.host,
            "decode_port": self.ident.port,
            "decode_tp_size": self.ident.tp_size,
            "local_block_ids": [list(req.blocks)],
            "remote_engine_id": p["remote_engine_id"],
            "remote_host": p["remote_host"],
            "remote_port": p["remote_port"],
            "remote_tp_size": p["tp_size"],
            "remote_pp_size": p.get("pp_size", 1),
        }
        if (tid := transfer_id(p)) is not None:
            msg["transfer_id"] = tid
        return msg
