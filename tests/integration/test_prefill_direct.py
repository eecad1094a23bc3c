"""The P leg's two paths (dispatch.prefill_leg) through the real Envoy and ext_proc: straight
to the engine (the default), parallel and serial dispatch work without the prefill listener,
P gets no routing header, and a P that cannot be reached is a 503 with Retry-After; through
Envoy's prefill listener, as before."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest_asyncio

from tests.support.engines import PULL
from tests.support.legs import (
    COMPLETION,
    assert_kv_pushed_by,
    assert_sent_together,
    held_prefills,
    legs,
)
from tests.support.topology import Topology, requests_total, topology

DIRECT = {"prefill_leg": "direct"}


@pytest_asyncio.fixture(scope="module")
async def direct() -> AsyncIterator[Topology]:
    async with topology(dispatch=DIRECT) as topo:
        yield topo


async def test_parallel_legs_go_straight_to_p_together(direct: Topology) -> None:
    await direct.clear()
    async with held_prefills(direct):
        for _ in range(4):
            status, body, _ = await direct.post("/v1/completions", COMPLETION)
            assert status == 200, body
    pairs = await legs(direct)
    assert len(pairs) == 4
    for p, d in pairs:
        assert_kv_pushed_by(d, direct.prefills[0].engine_id)
        assert "x-gateway-destination-endpoint" not in p["headers"]
        assert d["body"]["kv_transfer_params"]["remote_request_id"] == p["x_request_id"]
        assert_sent_together(p, d)
    metrics = await direct.metrics()
    assert metrics[requests_total("ok", "cache_hit", "parallel")] >= 4


async def test_pull_is_served_serially_with_the_params_of_p() -> None:
    async with topology(connectors=PULL, dispatch=DIRECT) as topo:
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        [(p, d)] = await legs(topo)
        assert p is not None and d["kv"] == "pull"


async def test_an_unreachable_prefill_is_a_503_with_retry_after_and_marked_down() -> None:
    # no probe: the leg's first connection to P is made after P stops accepting them
    async with topology(dispatch=DIRECT | {"probe": False}, health={"interval_s": 60}) as topo:
        prefill = topo.prefills[0]
        fault = {"refuse_connections": True, "refuse_for_s": 30}
        await topo.sim(prefill, "POST", "/sim/faults", fault)
        status, body, headers = await topo.post("/v1/completions", COMPLETION)
        assert status == 503, body
        assert headers["retry-after"] == "1"
        error = orjson.loads(body)["error"]
        assert error["code"] == 503 and "the prefill engine is unreachable" in error["message"]
        assert str(prefill.port) not in error["message"], error  # the log names it, not the client
        assert (await topo.ready())["prefill"][f"127.0.0.1:{prefill.port}"]["healthy"] is False


async def test_the_listener_path_still_serves_parallel_legs() -> None:
    async with topology(dispatch={"prefill_leg": "listener"}) as topo:
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        [(p, d)] = await legs(topo)
        assert_kv_pushed_by(d, topo.prefills[0].engine_id)
        # override_host read it on the way through Envoy's prefill_pool
        assert (
            p["headers"]["x-gateway-destination-endpoint"] == f"127.0.0.1:{topo.prefills[0].port}"
        )
