"""P's leased blocks going back to the pool let requests waiting for blocks start, without any
new arrival: the WRITE of a push, the READ of a pull and a lease's expiry all wake the engine.

A prefill engine whose KV cache holds one request at a time: the second request waits for the
first one's leased blocks. Run on the lab's virtual clock with the side channel
delivered in-process, so the waits below are simulated time, never the machine's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from lab.clock import run_virtual
from vllmsim.config import CostModel, Faults, KVTransferConfig
from vllmsim.engine import Engine, ErrorEvent, FinishEvent, KVMode, SimRequest
from vllmsim.metrics import Metrics
from vllmsim.nixl import side_channel
from vllmsim.nixl.base import ConnectorBase
from vllmsim.nixl.params import Identity
from vllmsim.nixl.pull import PullConnector
from vllmsim.nixl.push import PushConnector

FIRST, SECOND = list(range(1, 101)), list(range(1001, 1101))  # +1 output: 7 blocks of 16 each
COST = CostModel(num_gpu_blocks=10, api_overhead_ms=0.0, tokenize_per_token_ms=0.0)
P_ID = "p-engine"
WITHIN_S = 5.0  # simulated: far beyond a few steps and a transfer, far below the lease


def _p_engine(connector: str, lease_s: float) -> tuple[Engine, ConnectorBase]:
    engine = Engine(COST, Metrics("m", 0.0), P_ID)
    cls = PushConnector if connector == "NixlPushConnector" else PullConnector
    kv = KVTransferConfig(connector, "kv_producer", lease_duration_s=lease_s)
    engine.connector = conn = cls(engine, kv, Identity(P_ID, "sim", 1), Faults())
    return engine, conn


async def _finished(req: SimRequest) -> None:
    while not isinstance(event := await req.events.get(), FinishEvent):
        assert not isinstance(event, ErrorEvent), event.message


async def _second_waits_then(
    engine: Engine, conn: ConnectorBase, free_first: Callable[[], Awaitable[None]]
) -> SimRequest:
    """Two prefills; the second cannot fit until `free_first` returns the first one's
    leased blocks. Returns the second once it has finished (or fails after WITHIN_S)."""
    task = asyncio.get_running_loop().create_task(engine.run())
    try:
        first = SimRequest("first", FIRST, 1, mode=KVMode.PREFILL)
        second = SimRequest("second", SECOND, 1, mode=KVMode.PREFILL)
        engine.submit(first)
        engine.submit(second)
        await _finished(first)
        await asyncio.sleep(1.0)  # steps enough for the second to be admitted, were it to fit
        assert list(engine.waiting) == [second]
        assert engine.pool.used == 7  # the first one's lease
        await free_first()
        await asyncio.wait_for(_finished(second), WITHIN_S)
        return second
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await conn.close()


def _run(body: Callable[[], Awaitable[SimRequest]]) -> SimRequest:
    async def run() -> SimRequest:
        return await body()

    return run_virtual(run)


async def _d_side(host: str, port: int, msg: dict[str, Any], latency_s: float, **_: Any) -> Any:
    """D answers the writer's handshake and takes its write_done notif."""
    await asyncio.sleep(latency_s)
    return {"ok": True, "engine_id": "d-engine"}


def test_a_finished_push_write_lets_a_waiting_request_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(side_channel, "request", _d_side)
    engine, conn = _p_engine("NixlPushConnector", lease_s=1000.0)
    registration = {
        "type": "push_reg",
        "request_id": "first",
        "remote_engine_id": P_ID,
        "decode_engine_id": "d-engine",
        "decode_host": "sim",
        "decode_port": 2,
        "local_block_ids": [[1, 2, 3, 4, 5, 6, 7]],
    }

    async def register() -> None:
        assert (await conn.handle(registration))["ok"]

    second = _run(lambda: _second_waits_then(engine, conn, register))
    assert second.num_output == 1


def test_a_finished_pull_read_lets_a_waiting_request_start() -> None:
    engine, conn = _p_engine("NixlConnector", lease_s=1000.0)

    async def read() -> None:
        lease = conn.leases.get("first")
        assert lease is not None
        msg = {
            "type": "pull_read",
            "remote_engine_id": P_ID,
            "remote_request_id": "first",
            "remote_block_ids": [lease.blocks],
        }
        assert (await conn.handle(msg))["ok"]

    second = _run(lambda: _second_waits_then(engine, conn, read))
    assert second.num_output == 1


@pytest.mark.parametrize("connector", ["NixlPushConnector", "NixlConnector"])
def test_an_expired_lease_lets_a_waiting_request_start(connector: str) -> None:
    engine, conn = _p_engine(connector, lease_s=2.0)

    async def expire() -> None:
        await asyncio.sleep(2.0)  # no transfer: the lease runs out

    second = _run(lambda: _second_waits_then(engine, conn, expire))
    assert second.num_output == 1
