"""A real prefill engine with two data-parallel ranks (`--data-parallel-size 2`: one API server,
two engine cores, one per CPU core): the per-rank shapes vllmsim reproduces (docs/simulator.md's
data-parallel table) hold against vLLM itself. (A push from rank 1 is not checked here: rank 1
shares D's core on a 2-core box and, holding the push's blocks, starves D until its lease ends;
see docs/dispatch-and-failures.md.)"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio

from scripts.real_vllm import RealEngine
from tests.real_vllm.clients import PATHS, PROMPTS, body
from tests.support.real_vllm import EnginePool, engine_metrics

pytestmark = [pytest.mark.real_vllm, pytest.mark.pair("push_dp"), pytest.mark.timeout(600)]

RANK_HEADER = "X-data-parallel-rank"
P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
# A rank's first request waits for its first forward pass: minutes on a busy 2-core box.
FIRST_ANSWER_TIMEOUT_S = 180


async def _prefill(
    session: aiohttp.ClientSession, engine: RealEngine, rank: str | None
) -> tuple[int, dict[str, Any]]:
    """P's answer to a prefill request (P's kv_transfer_params), pinned to `rank` if given."""
    request = {
        **body("completions", PROMPTS[0], False, max_tokens=1),
        "kv_transfer_params": P_PARAMS,
    }
    # a fresh connection each: one the server is closing (after a 400) is never reused
    headers = {"Connection": "close"} | ({} if rank is None else {RANK_HEADER: rank})
    timeout = aiohttp.ClientTimeout(total=FIRST_ANSWER_TIMEOUT_S)
    async with session.post(
        engine.url + PATHS["completions"], json=request, headers=headers, timeout=timeout
    ) as response:
        return response.status, orjson.loads(await response.read())


def _per_rank(metrics: dict[str, float], name: str) -> dict[str, float]:
    """A per-engine series summed by its `engine` label."""
    totals: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(name + "{") and 'engine="' in key:
            rank = key.split('engine="', 1)[1].split('"', 1)[0]
            totals[rank] = totals.get(rank, 0.0) + value
    return totals


@pytest_asyncio.fixture(scope="module")
async def prefill(pool: EnginePool) -> RealEngine:
    engine, _ = await pool.get("push_dp")
    return engine


@pytest_asyncio.fixture(scope="module")
async def ranks(prefill: RealEngine, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
    """P's kv_transfer_params from rank 0 and from rank 1 (both ranks warm afterwards)."""
    params = []
    for rank in ("0", "1"):
        status, answer = await _prefill(session, prefill, rank)
        assert status == 200, answer
        params.append(answer["kv_transfer_params"])
    return params


async def test_each_rank_is_its_own_nixl_engine(
    prefill: RealEngine, ranks: list[dict[str, Any]]
) -> None:
    base = ranks[0]["remote_engine_id"].removesuffix("_dp0")
    assert base != ranks[0]["remote_engine_id"]
    for rank, params in enumerate(ranks):
        assert params["remote_engine_id"] == f"{base}_dp{rank}"
        assert params["remote_port"] == prefill.side_channel_port + rank
        assert params["remote_host"] == "127.0.0.1"


async def test_the_rank_header_is_range_checked(
    prefill: RealEngine, session: aiohttp.ClientSession, ranks: list[dict[str, Any]]
) -> None:
    status, answer = await _prefill(session, prefill, "2")
    assert status == 400, answer
    assert answer["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
    status, answer = await _prefill(session, prefill, "one")  # int() cannot read it: no header
    assert status == 200, answer
    engine_id = answer["kv_transfer_params"]["remote_engine_id"]
    assert engine_id in {r["remote_engine_id"] for r in ranks}


async def test_metrics_label_every_series_per_rank(
    prefill: RealEngine, session: aiohttp.ClientSession, ranks: list[dict[str, Any]]
) -> None:
    metrics = await engine_metrics(session, prefill)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert {k for k in metrics if k.startswith(name + "{")} == {
            f'{name}{{engine="{rank}",model_name="tiny"}}' for rank in (0, 1)
        }
    # each rank counted its own pinned request's prompt
    assert set(_per_rank(metrics, "vllm:prompt_tokens_total")) == {"0", "1"}
    assert all(v > 0 for v in _per_rank(metrics, "vllm:prompt_tokens_total").values())
