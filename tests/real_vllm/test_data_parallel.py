"""A real prefill engine with two data-parallel ranks (`--data-parallel-size 2`: one API server,
two engine cores, one per CPU core): the per-rank shapes vllmsim reproduces (docs/simulator.md's
data-parallel table) hold against vLLM itself, and a parallel push through Envoy and the ext_proc
pinned to rank 1 gives D rank 1's identity."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio

from extproc.testing import scrape
from scripts.real_vllm import RealEngine
from tests.real_vllm.clients import PATHS, PROMPTS, ask, body
from tests.support.real_vllm import EnginePool, Setup, by_source, engine_metrics, sidecar_for
from tests.support.topology import identity_events

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
    headers = {} if rank is None else {RANK_HEADER: rank}
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


@pytest_asyncio.fixture(scope="module")
async def push(
    pool: EnginePool, session: aiohttp.ClientSession, ranks: list[dict[str, Any]]
) -> AsyncIterator[Setup]:
    # No data_parallel_size in the config: the ranks come from P's /metrics page.
    async with sidecar_for(pool, "push_dp", session, dispatch={"mode": "auto"}) as setup:
        yield setup


async def _identities(setup: Setup) -> dict[str, Any]:
    async with setup.session.get(setup.sidecar.metrics + "/ready?verbose") as response:
        detail: dict[str, Any] = orjson.loads(await response.read())
    return dict(detail["identities"])


async def test_a_push_pinned_to_rank_1_gives_d_rank_1s_identity(
    push: Setup, ranks: list[dict[str, Any]]
) -> None:
    where = [f"{push.prefill.address} dp{rank}" for rank in (0, 1)]
    async with asyncio.timeout(60):  # the probe learns each rank's identity
        while True:
            known = await _identities(push)
            if all(known.get(w, {}).get("engine_id") for w in where):
                break
            await asyncio.sleep(0.2)  # polling /ready until the probes are in
    assert [known[w]["engine_id"] for w in where] == [r["remote_engine_id"] for r in ranks]

    expected = (await ask(push.session, push.prefill.url, "completions", PROMPTS[1], False)).text
    served: list[str] = []
    while "1" not in served:  # ties are taken in turn: rank 1 within two idle requests
        assert len(served) < 2, served
        before_p = _per_rank(
            await engine_metrics(push.session, push.prefill), "vllm:prompt_tokens_total"
        )
        before_d = by_source(await engine_metrics(push.session, push.decode))
        answer = await ask(push.session, push.sidecar.url, "completions", PROMPTS[1], False)
        assert answer.status == 200, answer.raw[:500]
        assert answer.text == expected
        after_p = _per_rank(
            await engine_metrics(push.session, push.prefill), "vllm:prompt_tokens_total"
        )
        after_d = by_source(await engine_metrics(push.session, push.decode))
        moved = [r for r in after_p if after_p[r] > before_p.get(r, 0.0)]
        assert len(moved) == 1, (before_p, after_p)  # P's leg was pinned to one rank
        served.append(moved[0])
        # every prompt token reached D by NIXL from the rank that prefilled it: D registered
        # its blocks with that rank's engine id and side channel, the identity it was given
        pushed = after_d.get("external_kv_transfer", 0.0) - before_d.get(
            "external_kv_transfer", 0.0
        )
        assert pushed == answer.prompt_tokens
        assert after_d.get("local_compute", 0.0) == before_d.get("local_compute", 0.0)

    sidecar = await scrape(push.session, push.sidecar.metrics + "/metrics")
    for w in where:
        assert sidecar.get(identity_events(w, "learned")) == 1
        assert sidecar.get(identity_events(w, "changed"), 0) == 0
    async with asyncio.timeout(10):  # counted from Envoy's access-log entry, a moment later
        while _parallel_ok(sidecar) < len(served):
            await asyncio.sleep(0.1)
            sidecar = await scrape(push.session, push.sidecar.metrics + "/metrics")
    assert _parallel_ok(sidecar) == len(served)


def _parallel_ok(sidecar: dict[str, float]) -> float:
    """Requests the sidecar answered with parallel dispatch (any reason)."""
    return sum(
        v
        for k, v in sidecar.items()
        if k.startswith("pd_extproc_requests_total{")
        and 'strategy="parallel"' in k
        and 'outcome="ok"' in k
    )
