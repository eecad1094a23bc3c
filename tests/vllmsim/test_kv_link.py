"""An engine's NIC: transfers it serves or posts at the same time share its bandwidth."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.vllmsim.vsim_helpers import d_body, metric, p_body, post
from vllmsim.config import CostModel
from vllmsim.cost_model import Link
from vllmsim.launcher import FAST, PULL_D, PULL_P, running_engine

BLOCK_BYTES, GBPS = 1_000_000, 0.1  # 10 ms per block
SLOW_LINK = ("--block-bytes", str(BLOCK_BYTES), "--kv-bandwidth-gbps", str(GBPS))


def test_a_transfer_posted_while_another_is_in_flight_waits_for_its_bytes() -> None:
    cost = CostModel(block_bytes=BLOCK_BYTES, kv_bandwidth_gbps=GBPS, kv_message_latency_ms=1.0)
    link = Link()
    assert abs(link.transfer(cost, 4, now=0.0) - 0.041) < 1e-9  # 4 x 10 ms + latency
    assert abs(link.transfer(cost, 2, now=0.010) - 0.051) < 1e-9  # behind 30 ms still queued
    assert abs(link.transfer(cost, 1, now=1.0) - 0.011) < 1e-9  # an idle link again


async def test_two_reads_served_at_once_by_one_prefill_take_longer_than_one(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        running_engine(*FAST, *SLOW_LINK, "--kv-transfer-config", PULL_P) as p,
        running_engine(*FAST, *SLOW_LINK, "--kv-transfer-config", PULL_D) as d,
    ):
        params = []
        for rid in ("a", "b"):
            status, body = await post(http, p, "/v1/completions", p_body(), rid=rid)
            assert status == 200
            params.append(body["kv_transfer_params"])
        replies = await asyncio.gather(
            *(
                post(http, d, "/v1/completions", d_body(kv), rid=f"d{i}")
                for i, kv in enumerate(params)
            )
        )
        assert [status for status, _ in replies] == [200, 200]
        total = await metric(http, p, "vllm:nixl_xfer_time_seconds_sum")
        moved = await metric(http, p, "vllm:nixl_bytes_transferred_total")
    one = moved / 2 / (GBPS * 1e9)  # one READ's bytes over the link
    # alone, each would take `one`; sharing P's NIC, the second waits for the first's bytes
    assert total > 2.5 * one
