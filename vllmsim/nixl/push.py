"""Push (WRITE) mode, after vLLM 0.33's NixlPushConnector, event by event and step-aligned.

Each engine has a writer (vLLM's `nixl-push-writer` thread). It owns the NIXL notifications:
one that arrives waits in the agent's inbox until the writer next runs. The writer runs when
the engine hands it work at the start of a step, when a step ends (vLLM's get_finished wakes
it), and every 1 ms while it holds finished blocks no registration matched yet.

D: the scheduler stages the registration when it allocates the request's blocks; at the start
   of that step the writer handshakes once per P engine (checking P's engine id) and sends
   PUSH_REG. The request then waits in WAITING_FOR_REMOTE_KVS (no timeout, as in vLLM: 0.32's
   soft watchdog, `push_registration_timeout`, defaulting to `decoder_kv_blocks_ttl` = 480 s,
   only logs and drops a registration not yet sent; it never fails the request) for the
   WRITE-completion notif. A P that restarts after answering and before its WRITE leaves it
   waiting so. The writer forwards that notif to the main thread when it next
   runs (a step end, or a step start that gives it registrations to send); the main thread
   counts forwarded notifs at a step's end; the request decodes from the next step.
P: after its 1-token step the blocks are leased; they reach the writer in the metadata of
   P's next step, as it starts. It pairs finished blocks with a registration by exact id,
   else by `transfer_id` when both carry one, else by base id (one `-<8hex>` suffix
   stripped). Whichever the writer sees second triggers the WRITE: scenario 1 ("parallel":
   D registered while P was still prefilling) or scenario 2 ("serial": P finished first).
   Before its first WRITE to a D engine the writer handshakes with it once.
The WRITE: P copies what its blocks hold into the block ids D registered, in order; the
write_done message stands in for the RDMA write and its completion notif at once, so it
carries the ids and the content. D stores it wherever those ids point.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllmsim.engine import SimRequest, State
from vllmsim.kv_cache import Lease
from vllmsim.kv_content import from_wire, num_prompt_blocks, to_wire
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
        self._staged: list[Lease] = []  # finished in the step that just ended
        self._finished: dict[str, Lease] = {}  # with the writer, waiting for a registration
        self._timelines: dict[str, SimRequest] = {}  # P request by lease id, for its timeline
        self._inbox: list[Registration] = []  # PUSH_REG notifs the writer has not read yet
        self._regs: list[Registration] = []  # read, waiting for their finished blocks
        self._writer_wake = asyncio.Event()
        self._poll_tick = False
        self._registering = False  # D: registrations staged for the step about to start
        self._writer: asyncio.Task[None] | None = None
        self._handshaken: set[tuple[str, int, str]] = set()  # D side: P engines
        self._handshaken_d: set[str] = set()  # P side: D engines
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._notified: set[SimRequest] = set()  # completion notif arrived, not forwarded
        self._forwarded: set[SimRequest] = set()  # forwarded by the writer, not yet counted

    # -- step hooks ----------------------------------------------------------------------
    def start_step(self) -> None:
        """P: blocks finished in the step that just ended ride in this step's metadata and
        reach the writer as it starts (vLLM on CPU schedules synchronously; on a GPU, async
        scheduling prepares this step while the device still runs the previous one, so the
        hand-off comes about as early)."""
        for lease in self._staged:
            if self.leases.get(lease.request_id) is lease:
                self._finished[lease.request_id] = lease
                self._note(lease.request_id, "blocks_to_writer", self.engine.steps + 1)
        if self._staged:
            self._wake_writer()
        self._staged = []
        if self._registering:  # D: the writer runs to send this step's registrations and
            self._registering = False  # forwards the notifs it finds on the way
            self._forwarded |= self._notified
            self._notified = set()

    def end_step(self) -> set[SimRequest]:
        """D (vLLM's get_finished, which also wakes the writer): count the completions the
        writer forwarded at an earlier step end; those it forwards now count at the next."""
        done = {r for r in self._forwarded if r.state is State.WAITING_FOR_REMOTE_KVS}
        self._forwarded, self._notified = self._notified, set()
        if self._inbox:
            self._wake_writer()
        return done

    def has_pending_work(self) -> bool:
        """What a step end must see: blocks to hand over, completions to forward or count.
        (vLLM also steps while blocks wait for a registration or a request waits for its KV;
        those steps change nothing until a notif arrives, so the simulator waits for the
        notif and then takes the step.)"""
        return bool(self._staged or self._notified or self._forwarded)

    # -- P side --------------------------------------------------------------------------
    def request_finished(self, req: SimRequest) -> dict[str, Any] | None:
        lease = Lease(req.internal_id, list(req.blocks), req.prompt_tokens, transfer_id(req.remote))
        self.leases.add(lease)
        self._staged.append(lease)
        self._timelines[lease.request_id] = req
        return prefill_params(self.ident, self.mode, req.blocks, req.internal_id, req.num_computed)

    def _note(self, request_id: str, event: str, step: int | None = None) -> None:
        req = self._timelines.get(request_id)
        if req is not None:
            req.note(event, self.engine.step_now if step is None else step)

    def _on_lease_expired(self, lease: Lease) -> None:
        self._finished.pop(lease.request_id, None)
        self._timelines.pop(lease.request_id, None)
        super()._on_lease_expired(lease)

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("type")
        if kind == "push_reg":
            return self._on_registration(msg)
        if kind == "write_done":
            return self._on_write_done(msg)
        return await super().handle(msg)

    def _on_registration(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A PUSH_REG notif lands in the agent's inbox; the writer reads it when it next runs."""
        if self.faults.drop_registrations:
            log.warning("fault: dropping PUSH_REG for %s", msg.get("request_id"))
            return {"ok": True}  # a NIXL notif has no delivery receipt either
        if (err := self.engine_id_error(msg)) is not None:
            return err
        self._inbox.append(Registration(msg))
        if self._finished:  # the writer is polling: it reads the notif at its next tick
            self._poll_tick = True
            self._wake_writer()
        return {"ok": True}

    def _wake_writer(self) -> None:
        self._ensure_writer()
        self._writer_wake.set()

    def _ensure_writer(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = self.spawn(self._writer_loop())

    async def _writer_loop(self) -> None:
        while True:
            await self._writer_wake.wait()
            self._writer_wake.clear()
            if self._poll_tick:  # self-polling while blocks wait: the next tick sees it
                self._poll_tick = False
                await asyncio.sleep(WRITER_POLL_S)
            self._regs += self._inbox
            self._inbox.clear()
            self._match()

    def _match(self) -> None:
        for rid, lease in list(self._finished.items()):
            reg = next((r for r in self._regs if _matches(lease, r)), None)
            if reg is None:
                continue
            self._regs.remove(reg)
            del self._finished[rid]
            self._note(rid, "push_reg_matched")
            self.spawn(self._write(lease, reg))

    async def _write(self, lease: Lease, reg: Registration) -> None:
        scenario = "parallel" if reg.arrived_at < lease.finished_at else "serial"
        self._note(lease.request_id, f"write_started_{scenario}")
        host, port = str(reg.msg["decode_host"]), int(reg.msg["decode_port"])
        try:
            await self._handshake_d(host, port, str(reg.msg.get("decode_engine_id")))
        except side_channel.SideChannelError as exc:
            log.error("P->D handshake failed for %s: %s", reg.request_id, exc)
            self.engine.metrics.lbl(self.engine.metrics.nixl_failed_notifs).inc()
            return
        d_blocks = block_group(reg.msg.get("local_block_ids")) or []
        sources = _suffix_for(lease, d_blocks, self.engine.block_size)
        await self.transfer(len(sources))  # the NIXL WRITE into D's blocks, through P's NIC
        blocks = to_wire(self.engine.pool.read(sources))
        self.leases.release(lease.request_id)
        self._note(lease.request_id, "write_done")
        self._timelines.pop(lease.request_id, None)
        targets = self.transfer_block_ids(d_blocks[: len(blocks)])
        notif = {
            "type": "write_done",
            "request_id": reg.request_id,
            "scenario": scenario,
            "engine_id": self.ident.engine_id,
            "local_block_ids": [targets],
            "blocks": blocks[: len(targets)],
        }
        try:
            await side_channel.request(host, port, notif, self.latency_s)
        except side_channel.SideChannelError as exc:
            log.error("WRITE notif to D failed for %s: %s", reg.request_id, exc)
            self.engine.metrics.lbl(self.engine.metrics.nixl_failed_notifs).inc()

    async def _handshake_d(self, host: str, port: int, engine_id: str) -> None:
        """P's writer handshakes once per D engine before its first WRITE there."""
        if engine_id in self._handshaken_d:
            return
        await side_channel.request(host, port, {"type": "handshake"}, self.latency_s)
        self._handshaken_d.add(engine_id)

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

    def _notif_arrived(self, req: SimRequest) -> None:
        """The completion notif is in D's agent inbox; the writer forwards it at a step end."""
        req.note("write_done_received", self.engine.step_now)
        self._notified.add(req)
        self.engine.wake()

    def abort(self, req: SimRequest) -> None:
        fut = self._waiters.pop(req.internal_id, None)
        if fut is not None:
            fut.cancel()
        self._notified.discard(req)
        self._forwarded.discard(req)
        super().abort(req)

    def start_recv(self, req: SimRequest) -> None:
        self._registering = True
        super().start_recv(req)

    async def _recv(self, req: SimRequest) -> None:
        p = req.remote or {}
        try:
            host, port = side_channel_address(p)
            await self._handshake(host, port, str(p["remote_engine_id"]))
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[req.internal_id] = fut
            req.note("push_reg_sent", self.engine.step_now)
            reply = await side_channel.request(host, port, self._registration(req), self.latency_s)
            if not reply.get("ok"):
                raise side_channel.SideChannelError(str(reply.get("error")))
        except (side_channel.SideChannelError, ValueError) as exc:
            self._waiters.pop(req.internal_id, None)
            self.engine.kv_failed(req, f"push_reg failed: {exc}", self.recompute_on_failure)
            return
        await fut  # no server-side timeout, as in vLLM 0.33
        self._notif_arrived(req)

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
            # D's prefix-cache hits are not written: D registers only its uncached blocks
            "local_block_ids": [list(req.blocks[req.num_cached_blocks : req.num_prompt_blocks])],
            "remote_engine_id": p["remote_engine_id"],
            "remote_host": p["remote_host"],
            "remote_port": p["remote_port"],
            "remote_tp_size": p["tp_size"],
            "remote_pp_size": p.get("pp_size", 1),
        }
        if (tid := transfer_id(p)) is not None:
            msg["transfer_id"] = tid
        return msg


def _suffix_for(lease: Lease, d_blocks: list[int], block_size: int) -> list[int]:
    """P's blocks to WRITE: as vLLM's push connector, when D registered fewer blocks than P
    holds for the prompt (D had a prefix-cache hit), P writes only the matching tail."""
    prompt = lease.blocks[: num_prompt_blocks(lease.num_tokens, block_size)]
    return prompt[max(0, len(prompt) - len(d_blocks)) :]
