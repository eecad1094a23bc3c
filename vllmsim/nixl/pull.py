"""Pull (READ) mode: D reads P's blocks, P answers when the READ would be done.

P: `request_finished` leases the blocks and returns pull-shaped params.
D: when its scheduler allocates the request (the start of that step), one `pull_read`
message to P's side channel naming the blocks to read (the `remote_block_ids` D was given);
P sleeps the bandwidth-modelled transfer time, replies with what those blocks hold and
releases the lease; D copies the content into its own blocks. D's main thread checks its
READ handles at the end of every step, so the request is seen done at the end of the first
step after the READ completes and decodes from the step after that. Like a one-sided READ,
P does not check that the blocks asked for belong to the request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllmsim.engine import SimRequest
from vllmsim.kv_cache import Lease
from vllmsim.kv_content import from_wire, to_wire
from vllmsim.nixl import side_channel
from vllmsim.nixl.base import ConnectorBase
from vllmsim.nixl.params import block_group, prefill_params, side_channel_address

log = logging.getLogger(__name__)


class PullConnector(ConnectorBase):
    mode = "pull"
    registration_generation = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_done: set[SimRequest] = set()  # READ complete, not yet checked by a step

    def end_step(self) -> set[SimRequest]:
        done, self._read_done = self._read_done, set()
        return done

    def has_pending_work(self) -> bool:
        return bool(self._read_done)

    def abort(self, req: SimRequest) -> None:
        self._read_done.discard(req)
        super().abort(req)

    def request_finished(self, req: SimRequest) -> dict[str, Any] | None:
        self.leases.add(Lease(req.internal_id, list(req.blocks), req.prompt_tokens, None))
        return prefill_params(
            self.ident,
            self.mode,
            req.blocks,
            req.internal_id,
            req.num_computed,
            self.registration_generation,
            self.kv.names_transfer_mode,
        )

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("type") != "pull_read":
            return await super().handle(msg)
        if (err := self.engine_id_error(msg)) is not None:
            return err
        lease = self.leases.get(str(msg.get("remote_request_id")))
        if lease is None:
            return {"ok": False, "error": "unknown or expired request"}
        block_ids = block_group(msg.get("remote_block_ids"))
        if block_ids is None:
            return {"ok": False, "error": "remote_block_ids is not a list of block id lists"}
        await self.transfer(len(block_ids))  # the READ, through P's NIC
        blocks = to_wire(self.engine.pool.read(self.transfer_block_ids(block_ids)))
        self.leases.release(lease.request_id)
        return {
            "ok": True,
            "num_blocks": len(blocks),
            "engine_id": self.ident.engine_id,
            "blocks": blocks,
        }

    async def _recv(self, req: SimRequest) -> None:
        p = req.remote or {}
        # As vLLM's pull connector: blocks D's prefix cache holds are not read; D reads P's
        # blocks past them into its own uncached blocks.
        skip = req.num_cached_blocks
        remote = p["remote_block_ids"]
        if skip and isinstance(remote, list):
            remote = [g[skip:] if isinstance(g, list) else g for g in remote]
        msg = {
            "type": "pull_read",
            "request_id": req.internal_id,
            "decode_engine_id": self.ident.engine_id,
            "remote_engine_id": p["remote_engine_id"],
            "remote_request_id": p["remote_request_id"],
            "remote_block_ids": remote,
        }
        started = time.monotonic()
        req.note("read_sent", self.engine.step_now)
        try:
            host, port = side_channel_address(p)
            reply = await side_channel.request(host, port, msg, self.latency_s, timeout=None)
        except (side_channel.SideChannelError, ValueError) as exc:
            reply = {"ok": False, "error": str(exc)}
        if reply.get("ok"):
            log.debug("pulled %s in %.1f ms", req.internal_id, 1e3 * (time.monotonic() - started))
            received = from_wire(reply.get("blocks"), "pull", str(reply.get("engine_id")))
            self.engine.pool.write(req.blocks[skip:], received)
            req.note("read_done", self.engine.step_now)
            self._read_done.add(req)
            self.engine.wake()
        else:
            self.engine.kv_failed(req, str(reply.get("error")), self.recompute_on_failure)
