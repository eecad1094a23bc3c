"""Data-parallel engines (vLLM's --data-parallel-size) through the real Envoy and ext_proc: one
vllmsim server with two ranks on each side, each rank its own NIXL engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.kv_routing import BLOCK, completion_body, loopback_events, model_dir, words
from tests.support.topology import (
    MODEL,
    PUSH,
    Topology,
    address,
    identity_events,
    requests_total,
    topology,
    until,
)
from vllmsim.launcher import FAST, running_engine

__all__ = ["loopback_events", "model_dir"]  # the fixtures, from tests/support

DP2 = ("--data-parallel-size", "2")
RANKS = {"data_parallel_size": 2}
RANK_HEADER = "x-data-parallel-rank"


ENDPOINTS = ("kv_events_endpoint", "kv_events_replay_endpoint")


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def _body(i: int) -> dict[str, Any]:
    """A prompt long enough that D registers while P still prefills (vllmsim's push-parallel)."""
    prompt = f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 30
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4}


async def _pairs(topo: Topology) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each D record with the P record of the same request (the sidecar's request id)."""
    p_by_id = {r["x_request_id"]: r for r in await topo.seen(topo.prefills[0])}
    return [(p_by_id[d["x_request_id"]], d) for d in await topo.seen(topo.decodes[0])]


async def test_every_request_is_parallel_with_the_chosen_ranks_identity() -> None:
    """Without ranks the two engines behind P's one port look like one engine whose identity
    changes between requests: D gets the wrong engine's identity (503s), then the endpoint
    goes serial for a cool-down. With them, every request is push-parallel, D gets the
    identity of the rank P's leg was pinned to, and both sides' ranks share the load."""
    async with topology(engine_flags=DP2, prefill=RANKS, decode=RANKS) as topo:
        await topo.clear()
        for i in range(8):
            status, body, _ = await topo.post("/v1/completions", _body(i))
            assert status == 200, body
        pairs = await _pairs(topo)
        assert len(pairs) == 8
        for p, d in pairs:
            # parallel dispatch: D got P's cached identity, not P's answer (no block ids)
            given = d["body"]["kv_transfer_params"]
            assert "remote_block_ids" not in given and d["kv"].startswith("push-")
            assert p["headers"][RANK_HEADER] == str(p["data_parallel_rank"])
            assert d["headers"][RANK_HEADER] == str(d["data_parallel_rank"])
            assert given["remote_engine_id"] == p["engine_id"]  # the pinned rank's engine
            assert (
                given["remote_port"]
                == topo.prefills[0].ranks[p["data_parallel_rank"]]["side_channel_port"]
            )
        # the load is spread (scraped queues a second old may tilt a few choices)
        for side in (0, 1):
            ranks = [pair[side]["data_parallel_rank"] for pair in pairs]
            assert min(ranks.count(0), ranks.count(1)) >= 2, ranks
        metrics = await topo.metrics()
        assert metrics.get(requests_total("ok", "cache_hit", "parallel")) == 8
        prefill = address(topo.prefills[0])
        for rank in (0, 1):
            where = f"{prefill} dp{rank}"
            assert metrics.get(identity_events(where, "learned")) == 1  # by the probe
            assert metrics.get(identity_events(where, "changed"), 0) == 0
            assert metrics.get(identity_events(where, "flapping"), 0) == 0


async def test_a_prefills_ranks_are_learned_from_its_metrics() -> None:
    """No data_parallel_size in the config: the ranks come from the `engine` labels of the
    engines' /metrics (P's read by every health check, D's by the KV check)."""
    async with topology(engine_flags=DP2) as topo:
        await topo.clear()
        for i in range(4):
            status, body, _ = await topo.post("/v1/completions", _body(i))
            assert status == 200, body
        pairs = await _pairs(topo)
        for p, d in pairs:
            assert p["headers"][RANK_HEADER] == str(p["data_parallel_rank"])
            assert d["headers"][RANK_HEADER] == str(d["data_parallel_rank"])
            assert d["body"]["kv_transfer_params"]["remote_engine_id"] == p["engine_id"]
        assert {p["data_parallel_rank"] for p, _ in pairs} == {0, 1}
        metrics = await topo.metrics()
        assert metrics.get(requests_total("ok", "cache_hit", "parallel")) == 4


async def test_a_rank_restart_drops_only_that_ranks_identity() -> None:
    async with topology(engine_flags=DP2, prefill=RANKS, decode=RANKS) as topo:
        p = topo.prefills[0]
        prefill = address(p)
        first = (await topo.ready())["identities"]
        assert [first[f"{prefill} dp{r}"]["engine_id"] for r in (0, 1)] == [
            rank["engine_id"] for rank in p.ranks
        ]
        restarted = await topo.sim(p, "POST", "/sim/restart", {"rank": 1})
        new_id = restarted["ranks"][1]["engine_id"]
        await topo.clear()
        statuses = []

        async def relearned() -> bool:
            status, _, _ = await topo.post("/v1/completions", _body(len(statuses)))
            statuses.append(status)
            known = (await topo.ready())["identities"][f"{prefill} dp1"]["engine_id"]
            return bool(known == new_id and status == 200)

        await until(relearned, "rank 1's new identity learned", timeout_s=15)
        # the one request sent to rank 1 with its old identity fails (503/502): no other
        assert statuses.count(200) >= len(statuses) - 1
        now = (await topo.ready())["identities"]
        assert now[f"{prefill} dp0"]["engine_id"] == p.ranks[0]["engine_id"]
        metrics = await topo.metrics()
        assert metrics.get(identity_events(f"{prefill} dp0", "dropped"), 0) == 0
        assert metrics.get(identity_events(f"{prefill} dp0", "changed"), 0) == 0
        assert metrics.get(identity_events(f"{prefill} dp1", "changed")) == 1
        for _ in range(4):  # rank 1 serves in parallel again
            status, _, _ = await topo.post("/v1/completions", _body(0))
            assert status == 200
        last = (await _pairs(topo))[-4:]
        assert all("remote_block_ids" not in d["body"]["kv_transfer_params"] for _, d in last)
        assert {p_rec["data_parallel_rank"] for p_rec, _ in last} == {0, 1}


async def test_a_clients_rank_header_never_reaches_an_engine(push_1p1d: Topology) -> None:
    """A client controls its prompt and sampling only: its X-data-parallel-rank is removed
    where D has no ranks (vLLM would answer 400 for rank 7 of 1) and replaced where it has."""
    topo = push_1p1d
    await topo.clear()
    status, body, _ = await topo.post(
        "/v1/completions", _body(0), headers={"X-data-parallel-rank": "7"}
    )
    assert status == 200, body
    [p], [d] = await topo.seen(topo.prefills[0]), await topo.seen(topo.decodes[0])
    assert RANK_HEADER not in p["headers"] and RANK_HEADER not in d["headers"]


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "learned"])
async def test_a_cached_prefix_goes_to_the_rank_that_holds_it(
    model_dir: Path, declared: bool
) -> None:
    """Each rank publishes its own KV events (vLLM: the pool's ports plus the rank), and the
    index keeps them per rank: prompts sharing a prefix that rank 1 of P holds are all pinned
    to rank 1 (without per-rank keys the sidecar hears rank 0's socket alone and spreads them
    by load). Ranks learned from P's /metrics move the subscriptions to the ranks' sockets."""
    # P binds its own ports (port 0: rank 0 a free one, rank 1 the next) and reports them
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
    }
    common = (*FAST, "--tokenizer", str(model_dir), "--block-size", str(BLOCK), *DP2)
    flags = (*common, "--kv-events-config", json.dumps(events))
    async with running_engine(*flags, "--kv-transfer-config", PUSH[0]) as p:
        pub, replay = (_port(p.ranks[0][key]) for key in ENDPOINTS)
        assert [_port(p.ranks[1][key]) for key in ENDPOINTS] == [pub + 1, replay + 1]
        prefill = {
            **(RANKS if declared else {}),
            "policy": "kv_cache",
            "kv_events": {"port": pub, "replay_port": replay},
        }
        async with topology(
            0,
            1,
            engine_flags=common,
            extra_prefills=[p],
            prefill=prefill,
            decode=RANKS,
            tokenizer=str(model_dir),
        ) as topo:
            shared = words(0, 120)
            async with topo.session.post(
                p.url + "/v1/completions",
                data=completion_body(f"{shared} w1 w2"),
                headers={"content-type": "application/json", RANK_HEADER: "1"},
            ) as response:
                assert response.status == 200, await response.text()
            batches = (
                "pd_extproc_kv_event_batches_total"
                f'{{endpoint="{address(p)} dp1",outcome="applied"}}'
            )

            async def heard() -> bool:
                return (await topo.metrics()).get(batches, 0) >= 1

            await until(heard, "rank 1's KV events applied")
            await topo.clear()
            for i in range(4):
                status, text, _ = await topo.post(
                    "/v1/completions", completion_body(f"{shared} marker-{i} w7")
                )
                assert status == 200, text
            ranks = [r["data_parallel_rank"] for r in await topo.seen(p)]
            assert ranks == [1, 1, 1, 1]
            cached = await topo.metrics()
            assert cached.get('pd_extproc_kv_cached_prompt_tokens_total{role="prefill"}') == 480
