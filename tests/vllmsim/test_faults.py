"""Fault injection through /sim/faults and /sim/restart, and the CLI fault flags."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.vllmsim.vsim_helpers import PROMPT, eventually, get_json, metric, post
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, running_engine

BODY = {"prompt": PROMPT, "max_tokens": 2}


async def test_fail_next_and_latency(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, "--fail-next", "1", "--fail-status", "503") as eng:
        status, body = await post(http, eng, "/v1/completions", BODY)
        assert status == 503 and body["error"]["code"] == 503
        assert (await post(http, eng, "/v1/completions", BODY))[0] == 200
        async with http.post(eng.url + "/sim/faults", json={"fail_next": 2, "latency_ms": 150}):
            pass
        started = time.monotonic()
        statuses = [(await post(http, eng, "/v1/completions", BODY))[0] for _ in range(3)]
        assert statuses == [500, 500, 200]
        assert time.monotonic() - started >= 0.45
        async with http.delete(eng.url + "/sim/faults") as resp:
            assert (await resp.json())["latency_ms"] == 0


async def test_hang_until_client_gives_up(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, "--hang-next", "1") as eng:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await post(http, eng, "/v1/completions", BODY, rid="hung")

        async def aborted() -> bool:
            recs = await get_json(http, eng, "/sim/requests")
            return recs[0]["outcome"] == "aborted"

        await eventually(aborted)
        assert (await post(http, eng, "/v1/completions", BODY))[0] == 200
        async with http.delete(eng.url + "/sim/requests"):
            pass
        assert await get_json(http, eng, "/sim/requests") == []


async def test_refuse_connections_for_a_while(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST) as eng:
        async with http.post(
            eng.url + "/sim/faults", json={"refuse_connections": True, "refuse_for_s": 1.0}
        ) as resp:
            assert (await resp.json())["refuse_connections"] is True
        async with aiohttp.ClientSession() as fresh:  # a new connection, not a pooled one
            with pytest.raises(aiohttp.ClientConnectorError):
                await fresh.get(eng.url + "/health")

            async def back() -> bool:
                try:
                    async with fresh.get(eng.url + "/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectorError:
                    return False

            await eventually(back, within=5)


async def test_restart_changes_identity_and_drops_work(http: aiohttp.ClientSession) -> None:
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        before = await get_json(http, p, "/sim/state")
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": p.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": p.side_channel_port,
            "tp_size": 1,
            "remote_request_id": "r",
        }
        body = {**BODY, "kv_transfer_params": params}
        waiting = asyncio.create_task(post(http, d, "/v1/completions", body, rid="r"))

        async def parked() -> bool:
            return (await get_json(http, d, "/sim/state"))["waiting"] == 1

        await eventually(parked)
        await post(http, p, "/v1/completions", BODY)  # some counters to reset
        async with http.post(d.url + "/sim/restart") as resp:
            d_state = await resp.json()
        with pytest.raises(aiohttp.ClientError):  # the in-flight request's connection dies
            await asyncio.wait_for(waiting, 5)
        assert d_state["engine_id"] != d.engine_id and d_state["blocks_used"] == 0
        async with http.post(p.url + "/sim/restart", json={}) as resp:
            after = await resp.json()
        assert after["engine_id"] != before["engine_id"]
        assert after["process_start_time"] > before["process_start_time"]
        assert await metric(http, p, "vllm:generation_tokens_total") == 0
        # D still holding the old identity now gets a failed recv -> 500.
        status, _ = await post(http, d, "/v1/completions", body, rid="r2")
        assert status == 500


async def test_drop_registrations_leaves_d_waiting(http: aiohttp.ClientSession) -> None:
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P, "--drop-registrations") as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        _, pr = await post(
            http,
            p,
            "/v1/completions",
            {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            rid="drop",
        )
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await post(
                    http,
                    d,
                    "/v1/completions",
                    {**BODY, "kv_transfer_params": pr["kv_transfer_params"]},
                    rid="drop",
                )
        assert "dropping PUSH_REG" in p.log_text()
