"""`--data-parallel-size N`: one API server, N engine ranks, with vLLM's per-rank shapes."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.engines import two_free_ports
from tests.vllmsim.vsim_helpers import d_body, get_json, p_body, post, record
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, running_engine

DP2 = ("--data-parallel-size", "2")


async def _rank_header(
    http: aiohttp.ClientSession, url: str, rank: str, rid: str
) -> tuple[int, dict[str, object]]:
    async with http.post(
        url + "/v1/completions",
        json=p_body(),
        headers={"X-data-parallel-rank": rank, "X-Request-Id": rid},
    ) as resp:
        return resp.status, await resp.json()


async def test_ranks_have_vllms_engine_ids_and_side_channel_ports(
    http: aiohttp.ClientSession,
) -> None:
    base = two_free_ports()
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(base)}
    async with running_engine(*FAST, *DP2, "--kv-transfer-config", PUSH_P, env=env) as p:
        ranks = p.ranks
        assert [r["rank"] for r in ranks] == [0, 1]
        assert [r["side_channel_port"] for r in ranks] == [base, base + 1]
        ids = [str(r["engine_id"]) for r in ranks]
        stem = ids[0].removesuffix("_dp0")
        assert ids == [f"{stem}_dp0", f"{stem}_dp1"] and stem != ids[0]
        for rank in (0, 1):  # what P returns is the rank's own identity
            status, body = await _rank_header(http, p.url, str(rank), f"pin-{rank}")
            assert status == 200
            params = body["kv_transfer_params"]
            assert isinstance(params, dict)
            assert params["remote_engine_id"] == ids[rank]
            assert params["remote_port"] == base + rank
            rec = await record(http, p, f"pin-{rank}")
            assert rec["data_parallel_rank"] == rank and rec["engine_id"] == ids[rank]


async def test_without_data_parallelism_the_id_has_no_suffix(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p:
        assert "_dp" not in p.engine_id and len(p.ranks) == 1
        status, body = await _rank_header(http, p.url, "1", "out")
        assert status == 400  # as vLLM: rank 1 of one
        assert body["error"]["message"] == "data_parallel_rank 1 is out of range [0, 1)."


async def test_a_rank_out_of_range_is_400_and_a_non_integer_is_balanced(
    http: aiohttp.ClientSession,
) -> None:
    async with running_engine(*FAST, *DP2, "--kv-transfer-config", PUSH_P) as p:
        status, body = await _rank_header(http, p.url, "2", "two")
        assert status == 400
        assert body["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
        status, _ = await _rank_header(http, p.url, "-1", "minus")
        assert status == 400
        status, _ = await _rank_header(http, p.url, "one", "word")  # vLLM: as no header
        assert status == 200
        assert (await record(http, p, "word"))["data_parallel_rank"] in (0, 1)


async def test_unpinned_requests_spread_over_the_ranks(http: aiohttp.ClientSession) -> None:
    slow = ("--step-base-ms", "20", "--api-overhead-ms", "0")  # requests overlap
    async with running_engine(*slow, *DP2) as eng:
        body = {"model": "sim-model", "prompt": "hello", "max_tokens": 4}
        answers = await asyncio.gather(
            *(post(http, eng, "/v1/completions", body, rid=f"lb-{i}") for i in range(8))
        )
        assert all(status == 200 for status, _ in answers)
        ranks = [(await record(http, eng, f"lb-{i}"))["data_parallel_rank"] for i in range(8)]
        assert sorted(ranks) == [0, 0, 0, 0, 1, 1, 1, 1]


async def test_metrics_carry_one_series_per_rank(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, *DP2) as eng:
        await _rank_header(http, eng.url, "1", "m")
        async with http.get(eng.url + "/metrics") as resp:
            text = await resp.text()
        assert text.count("# TYPE vllm:num_requests_running gauge") == 1
        for rank in ("0", "1"):
            assert f'vllm:num_requests_waiting{{engine="{rank}",model_name="sim-model"}}' in text
        assert 'vllm:generation_tokens_total{engine="1",model_name="sim-model"} 1.0' in text
        assert 'vllm:generation_tokens_total{engine="0",model_name="sim-model"} 0.0' in text
        assert text.count("\nprocess_start_time_seconds ") == 1


async def test_push_between_ranks_of_two_servers(http: aiohttp.ClientSession) -> None:
    """P's rank 1 pushes to D's rank 0: each rank's connector on its own side channel."""
    async with (
        running_engine(*FAST, *DP2, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, *DP2, "--kv-transfer-config", PUSH_D) as d,
    ):
        status, pr = await _rank_header(http, p.url, "1", "x")
        assert status == 200
        params = pr["kv_transfer_params"]
        assert isinstance(params, dict)
        async with http.post(
            d.url + "/v1/completions",
            json=d_body(params),
            headers={"X-data-parallel-rank": "0", "X-Request-Id": "x"},
        ) as resp:
            assert resp.status == 200
        rec = await record(http, d, "x")
        assert rec["kv"] == "push-serial" and rec["data_parallel_rank"] == 0
        assert rec["kv_evidence"]["engine_ids"] == [p.ranks[1]["engine_id"]]


async def test_one_rank_restarts_alone(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, *DP2, "--kv-transfer-config", PUSH_P) as p:
        before = [r["engine_id"] for r in p.ranks]
        async with http.post(p.url + "/sim/restart", json={"rank": 1}) as resp:
            assert resp.status == 200
        after = [r["engine_id"] for r in (await get_json(http, p, "/sim/state"))["ranks"]]
        assert after[0] == before[0]
        assert after[1] != before[1] and after[1].endswith("_dp1")
        async with http.post(p.url + "/sim/restart", json={"rank": 2}) as resp:
            assert resp.status == 400
        async with http.post(p.url + "/sim/restart", json={}) as resp:  # the whole server
            ids = [r["engine_id"] for r in (await resp.json())["ranks"]]
        assert ids[0] != before[0] and ids[1] != after[1]
        assert ids[0].removesuffix("_dp0") == ids[1].removesuffix("_dp1")
