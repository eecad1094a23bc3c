"""The sidecar's own metrics say what happened: in-flight counts, outcomes, series, buckets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from extproc.testing import scrape
from tests.integration.conftest import MODEL, PULL, PUSH, Topology, address, topology, until

SLOW = ("--step-base-ms", "50")  # 1000 tokens: a stream open for ~50 s, far longer than a test
LONG = {"model": MODEL, "prompt": "Once upon a time " * 20, "max_tokens": 1000, "stream": True}
INFLIGHT = 'pd_extproc_inflight_requests{{endpoint="{}",role="{}"}}'


@contextlib.asynccontextmanager
async def streaming(topo: Topology) -> AsyncIterator[aiohttp.ClientResponse]:
    """A long generation, held open once its first event has arrived (so P has answered)."""
    async with topo.session.post(topo.sidecar.url + "/v1/completions", json=LONG) as response:
        assert response.status == 200, await response.text()
        await asyncio.wait_for(response.content.readline(), 10)
        yield response


async def inflight(topo: Topology, role: str) -> dict[str, float]:
    metrics = await scrape(topo.session, topo.sidecar.metrics + "/metrics")
    engines = topo.prefills if role == "prefill" else topo.decodes
    return {address(e): metrics.get(INFLIGHT.format(address(e), role), 0.0) for e in engines}


@pytest.mark.parametrize(
    ("connectors", "config"),
    [
        (PUSH, {}),  # parallel (the probe learnt P's identity)
        (PUSH, {"dispatch": {"probe": False}}),  # serial, cache_miss
        (PULL, {}),  # serial, pull
        (PUSH, {"dispatch": {"prefill_leg": "listener"}}),  # parallel, through Envoy
        (PULL, {"dispatch": {"prefill_leg": "listener"}}),  # serial, through Envoy
    ],
    ids=["parallel", "serial", "pull", "parallel-listener", "pull-listener"],
)
async def test_a_prefill_is_counted_in_flight_only_while_its_leg_runs(
    connectors: tuple[str, str], config: dict[str, Any]
) -> None:
    async with topology(connectors=connectors, engine_flags=SLOW, **config) as topo:
        async with streaming(topo) as response:
            # P answered long ago; D is still generating
            async def prefill_released() -> bool:
                return set((await inflight(topo, "prefill")).values()) == {0.0}

            await until(prefill_released, "the prefill's in-flight count to drop")
            assert list((await inflight(topo, "decode")).values()) == [1.0]
            assert not response.content.at_eof()


async def test_a_serial_retry_is_counted_at_the_fallback_while_it_runs_only() -> None:
    # the first prefill refuses connections: the P leg is retried on the other one
    config = {"dispatch": {"probe": False}, "health": {"interval_s": 30}}
    async with topology(n_prefill=2, engine_flags=SLOW, **config) as topo:
        down, up = topo.prefills
        await topo.sim(down, "POST", "/sim/faults", {"refuse_connections": True,
                                                      "refuse_for_s": 30})  # fmt: skip
        for _ in range(2):  # round robin: one of them picks the refusing engine first
            async with streaming(topo):
                async def prefill_released() -> bool:
                    return set((await inflight(topo, "prefill")).values()) == {0.0}

                await until(prefill_released, "the prefills' in-flight counts to drop")
                assert list((await inflight(topo, "decode")).values()) == [1.0]
        retries = (await topo.metrics())['pd_extproc_prefill_retries_total{reason="unreachable"}']
        assert retries == 1
        assert len(await topo.seen(up)) == 2
