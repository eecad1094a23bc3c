"""Dispatch through a real Envoy, the real ext_proc and vllmsim engines: parallel and serial
legs, the bodies and headers each engine gets, streaming."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from multidict import CIMultiDict

from tests.support.engines import MODEL, PULL, address
from tests.support.legs import (
    COMPLETION,
    P_HOLD_S,
    assert_kv_pushed_by,
    assert_sent_together,
    held_prefills,
    legs,
)
from tests.support.topology import Topology, generated_text, requests_total, topology

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a story " * 10}],
    "max_tokens": 8,
    "temperature": 0,
}


async def test_probe_makes_the_first_request_parallel() -> None:
    async with topology() as topo:
        async with held_prefills(topo):
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        [(p, d)] = await legs(topo)
        assert_kv_pushed_by(d, topo.prefills[0].engine_id)
        assert d["body"]["kv_transfer_params"]["remote_request_id"] == p["x_request_id"]
        assert_sent_together(p, d)
        metrics = await topo.metrics()
        key = requests_total("ok", "cache_hit", "parallel")
        assert metrics[key] == 1
        # disaggregated == aggregated: the text follows the KV D received
        assert generated_text("/v1/completions", body) == await topo.aggregated(
            "/v1/completions", COMPLETION
        )


async def test_parallel_legs_reach_the_engines_together(push_1p1d: Topology) -> None:
    topo = push_1p1d
    await topo.clear()
    async with held_prefills(topo):
        for _ in range(4):
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
    pairs = await legs(topo)
    assert len(pairs) == 4
    for p, d in pairs:
        assert_sent_together(p, d)
        assert_kv_pushed_by(d, topo.prefills[0].engine_id)


async def test_without_probe_first_request_per_prefill_is_serial_then_parallel() -> None:
    async with topology(n_prefill=2, dispatch={"probe": False}) as topo:
        async with held_prefills(topo):
            for _ in range(4):  # round robin: two per prefill
                status, body, _ = await topo.post("/v1/completions", COMPLETION)
                assert status == 200, body
        pairs = await legs(topo)
        # serial: D gets P's own params (P's internal request id) after P answered;
        # parallel: D gets the cached identity with the router's id, at the same time as P
        for p, d in pairs[:2]:
            assert d["received_at"] - p["received_at"] >= P_HOLD_S
            assert d["body"]["kv_transfer_params"]["remote_request_id"].startswith("cmpl-")
        for p, d in pairs[2:]:
            assert d["body"]["kv_transfer_params"]["remote_request_id"] == p["x_request_id"]
            assert_sent_together(p, d)
        metrics = await topo.metrics()
        assert metrics[requests_total("ok", "cache_miss", "serial")] == 2
        assert metrics[requests_total("ok", "cache_hit", "parallel")] == 2


@pytest.mark.parametrize("flags", [(), ("--pre-0-28",)], ids=["named", "before-0.28"])
async def test_pull_mode_is_serial_with_params_verbatim(flags: tuple[str, ...]) -> None:
    # Before vLLM 0.28 P's params name no transfer_mode (pull was the only one): in auto mode
    # a known identity without it is served serially too, as pull, never in parallel.
    mode = None if flags else "pull"
    async with topology(connectors=PULL, engine_flags=flags) as topo:
        answers = []
        for _ in range(3):
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
            answers.append(generated_text("/v1/completions", body))
        for p, d in await legs(topo):
            assert d["kv"] == "pull"
            assert d["kv_evidence"]["engine_ids"] == [topo.prefills[0].engine_id]
            assert d["received_at"] > p["received_at"]
            # P's answer is not visible to the test, but its id and block ids are: they
            # must have reached D untouched.
            params = d["body"]["kv_transfer_params"]
            assert params.get("transfer_mode") == mode
            assert params["remote_request_id"].startswith(f"cmpl-{p['x_request_id']}-0-")
            assert params["remote_block_ids"] and isinstance(params["remote_block_ids"][0], list)
        metrics = await topo.metrics()
        assert metrics[requests_total("ok", "pull", "serial")] == 3
        assert answers == [await topo.aggregated("/v1/completions", COMPLETION)] * 3
        [identity] = (await topo.ready())["identities"].values()
        assert identity["engine_id"] == topo.prefills[0].engine_id
        assert identity["transfer_mode"] == mode


@pytest.mark.parametrize(
    "path,body",
    [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
    ids=["completions", "chat"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_both_apis_streaming_and_not(
    push_1p1d: Topology, path: str, body: dict, stream: bool
) -> None:
    topo = push_1p1d
    await topo.clear()
    request = body | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})
    async with held_prefills(topo):
        status, payload, _ = await topo.post(path, request)
    assert status == 200, payload
    [(p, d)] = await legs(topo)
    assert p["path"] == d["path"] == path
    assert p["x_request_id"] == d["x_request_id"]
    assert_kv_pushed_by(d, topo.prefills[0].engine_id)
    assert_sent_together(p, d)
    # P: one token, whole answer; D: what the client asked for
    assert p["body"]["max_tokens"] == 1 and p["body"]["stream"] is False
    assert "stream_options" not in p["body"]
    assert d["body"].get("stream", False) is stream
    assert d["body"]["max_tokens"] == 8
    if stream:
        events = payload.decode().split("\n\n")
        assert events[-2] == "data: [DONE]"
        usage = orjson.loads(events[-3].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 8
    else:
        assert orjson.loads(payload)["usage"]["completion_tokens"] == 8
    # disaggregated == aggregated, byte for byte: the text follows the KV D received
    assert generated_text(path, payload) == await topo.aggregated(path, request)


async def test_content_length_matches_the_rewritten_body(push_1p1d: Topology) -> None:
    topo = push_1p1d
    await topo.clear()
    prompt = "é語🦊 " * 1000  # 2-, 3- and 4-byte UTF-8, sent unescaped: bytes != characters
    raw = orjson.dumps(COMPLETION | {"prompt": prompt})
    assert b"\xf0\x9f\xa6\x8a" in raw
    status, body, _ = await topo.post("/v1/completions", raw)
    assert status == 200, body
    [(p, d)] = await legs(topo)
    for record in (p, d):
        assert int(record["headers"]["content-length"]) == record["body_bytes"]
        assert record["body"]["prompt"] == prompt


async def test_client_routing_fields_never_reach_an_engine(push_1p1d: Topology) -> None:
    topo = push_1p1d
    await topo.clear()
    evil = {
        "do_remote_prefill": True,
        "remote_host": "203.0.113.9",
        "remote_port": 1,
        "remote_engine_id": "attacker",
        "tp_size": 1,
        "remote_request_id": "x",
    }
    status, body, _ = await topo.post(
        "/v1/completions",
        COMPLETION | {"kv_transfer_params": evil},
        headers={"x-gateway-destination-endpoint": "203.0.113.9:80", "x-request-id": "mine"},
    )
    assert status == 200, body
    [(p, d)] = await legs(topo)
    assert "attacker" not in orjson.dumps([p["body"], d["body"]]).decode()
    assert d["body"]["kv_transfer_params"]["remote_engine_id"] == topo.prefills[0].engine_id
    assert p["x_request_id"] != "mine"  # a fresh id per dispatch, never the client's
    for record in (p, d):
        assert "203.0.113.9" not in record["headers"].get("x-gateway-destination-endpoint", "")


async def test_client_connector_params_in_vllm_xargs_reach_no_engine() -> None:
    # vLLM merges vllm_xargs into extra_args, where its connectors read kv_transfer_params and
    # ec_transfer_params (the body's own field wins only when set: never on D alone)
    decision = {"mode": "threshold", "max_prompt_tokens": 64}
    async with topology(decision=decision) as topo:
        evil = {
            "ec_transfer_params": {"remote_host": "203.0.113.9"},
            "vllm_xargs": {
                "kv_transfer_params": "203.0.113.9",
                "ec_transfer_params": "203.0.113.9",
                "kv_cache_report_mode": "full",
                "mine": 1,
            },
        }
        short = COMPLETION | {"prompt": "Say hi"}
        for body in (short, COMPLETION | {"prompt": "The quick brown fox " * 50}):
            status, payload, _ = await topo.post("/v1/completions", body | evil)
            assert status == 200, payload
        records = [r for e in topo.engines for r in await topo.seen(e)]
        assert len(records) == 3  # D alone, then P and D
        for record in records:
            assert "203.0.113.9" not in orjson.dumps(record["body"]).decode()
            assert record["body"]["vllm_xargs"] == {"mine": 1}
            assert "ec_transfer_params" not in record["body"]


PRIORITY_BODY = b', "priority": -100, "pr\\u0069ority": -99}'  # the escaped key counts too


async def test_a_clients_engine_priority_reaches_no_engine() -> None:
    """vLLM's `priority` field and X-Vllm-Priority header order an engine's queue (and pick
    whom it preempts) under --scheduling-policy priority: the operator's, not the client's."""
    decision = {"mode": "threshold", "max_prompt_tokens": 64}
    async with topology(decision=decision) as topo:
        short = COMPLETION | {"prompt": "Say hi"}
        for body in (short, COMPLETION | {"prompt": "The quick brown fox " * 50}):
            raw = orjson.dumps(body)[:-1] + PRIORITY_BODY
            status, payload, _ = await topo.post(
                "/v1/completions", raw, headers={"X-Vllm-Priority": "-5"}
            )
            assert status == 200, payload
        records = [r for e in topo.engines for r in await topo.seen(e)]
        assert len(records) == 3  # D alone, then P and D
        for record in records:
            assert "priority" not in record["body"], record["body"]
            assert "x-vllm-priority" not in record["headers"], record["headers"]


async def test_an_operator_may_let_clients_set_the_engine_priority() -> None:
    dispatch = {
        "client_engine_priority": True,
        "forward_headers": ["authorization", "x-vllm-priority"],
    }
    async with topology(dispatch=dispatch) as topo:
        raw = orjson.dumps(COMPLETION)[:-1] + b', "priority": -100}'
        status, payload, _ = await topo.post(
            "/v1/completions", raw, headers={"X-Vllm-Priority": "-5"}
        )
        assert status == 200, payload
        [(p, d)] = await legs(topo)
        for record in (p, d):
            assert record["body"]["priority"] == -100
            assert record["headers"]["x-vllm-priority"] == "-5"


async def test_a_repeated_trace_header_reaches_each_leg_once(push_1p1d: Topology) -> None:
    topo = push_1p1d
    await topo.clear()
    first = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    second = "00-11111111111111111111111111111111-2222222222222222-01"
    headers = CIMultiDict(
        [
            ("traceparent", first),
            ("traceparent", second),
            ("tracestate", "a=1"),
            ("tracestate", "b=2"),
        ]
    )
    status, body, _ = await topo.post("/v1/completions", COMPLETION, headers=headers)
    assert status == 200, body
    [(p, d)] = await legs(topo)
    for record in (p, d):  # the engines' log joins repeated values with ", "
        assert record["headers"]["traceparent"] == first
        assert record["headers"]["tracestate"] == "a=1,b=2"


async def test_sse_chunks_arrive_as_they_are_generated() -> None:
    # 20 ms decode steps: 10 tokens take ~200 ms; a buffering proxy would deliver them at once.
    flags = ("--step-base-ms", "20", "--prefill-per-token-ms", "0.001")
    async with topology(engine_flags=flags) as topo:
        arrivals = []
        async with topo.session.post(
            topo.sidecar.url + "/v1/completions",
            json=COMPLETION | {"stream": True, "max_tokens": 10},
        ) as response:
            async for _ in response.content.iter_any():
                arrivals.append(time.perf_counter())
        assert len(arrivals) >= 5
        assert arrivals[-1] - arrivals[0] > 0.1


async def test_two_by_two_uses_every_endpoint() -> None:
    async with topology(n_prefill=2, n_decode=2) as topo:
        results = await asyncio.gather(
            *(topo.post("/v1/completions", COMPLETION) for _ in range(8))
        )
        assert [status for status, _, _ in results] == [200] * 8
        for engine in topo.engines:
            assert len(await topo.seen(engine)) >= 2, (address(engine), await topo.ready())
        for p, d in await legs(topo):  # all dispatched in parallel (identities probed)
            assert d["body"]["kv_transfer_params"]["remote_request_id"] == p["x_request_id"]
