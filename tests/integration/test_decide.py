"""The decode-only decision, admission control and the serial prefill retry, through a real
Envoy, the real ext_proc and vllmsim engines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from extproc.testing import scrape
from tests.support.engines import MODEL, PULL, PUSH, address
from tests.support.polling import until
from tests.support.topology import Topology, requests_total, topology

SHORT = {"model": MODEL, "prompt": "Say hi " * 10, "max_tokens": 2}  # ~20 tokens
LONG = {"model": MODEL, "prompt": "The quick brown fox jumps " * 200, "max_tokens": 2}  # ~1000


def decisions(decision: str, reason: str) -> str:
    return f'pd_extproc_dispatch_decisions_total{{decision="{decision}",reason="{reason}"}}'


async def was_disaggregated(topo: Topology) -> list[bool]:
    """Per user request D saw, oldest first: did it come with kv_transfer_params?"""
    records = sorted(await topo.seen(topo.decodes[0]), key=lambda r: r["received_at"])
    return ["kv_transfer_params" in r["body"] for r in records]


@contextlib.asynccontextmanager
async def held_streams(
    topo: Topology, count: int, headers: dict[str, str] | None = None
) -> AsyncIterator[None]:
    """`count` streaming requests in flight (their first chunk read) until the block ends."""
    body = {"model": MODEL, "prompt": "Keep going", "max_tokens": 2000, "stream": True}
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(count):
            post = topo.session.post(
                topo.sidecar.url + "/v1/completions", json=body, headers=headers or {}
            )
            response = await stack.enter_async_context(post)
            assert response.status == 200, await response.text()
            await asyncio.wait_for(response.content.readline(), 10)
        yield


# ---- the decision --------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "connectors"), [("auto", PUSH), ("pull", PULL)])
async def test_threshold_sends_short_prompts_alone_and_long_ones_through_p(
    mode: str, connectors: tuple[str, str]
) -> None:
    decision = {"mode": "threshold", "max_prompt_tokens": 64}
    async with topology(connectors=connectors, dispatch={"mode": mode}, decision=decision) as topo:
        for body in (SHORT, LONG):
            status, payload, _ = await topo.post("/v1/completions", body)
            assert status == 200, payload
        assert await was_disaggregated(topo) == [False, True]
        assert len(await topo.seen(topo.prefills[0])) == 1  # only the long prompt's P leg
        metrics = await topo.metrics()
        assert metrics[decisions("decode_only", "short_prompt")] == 1
        assert metrics[decisions("disaggregate", "long_prompt")] == 1
        assert metrics[requests_total("ok", "short_prompt", "decode_only")] == 1


async def test_load_aware_goes_alone_on_idle_engines_and_through_p_when_d_is_busy() -> None:
    async with topology(decision={"mode": "load_aware"}) as topo:
        status, payload, _ = await topo.post("/v1/completions", SHORT)  # idle: D alone wins
        assert status == 200, payload
        async with held_streams(topo, 1):  # D now runs a request: a long prefill would stall it
            status, payload, _ = await topo.post("/v1/completions", LONG)
            assert status == 200, payload
            status, payload, _ = await topo.post("/v1/completions", SHORT)  # a small stall
            assert status == 200, payload
        # the held stream went alone too (D was idle when it came)
        assert await was_disaggregated(topo) == [False, False, True, False]
        metrics = await topo.metrics()
        assert metrics[decisions("decode_only", "faster_alone")] == 3
        assert metrics[decisions("disaggregate", "stall_budget")] == 1


TINY_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BULK = "lorem ipsum " * 17_000  # 200 KB, ~50k tokens
TOOL = {"type": "function", "function": {"name": "f", "description": BULK}}
# A tiny message, with a prompt vLLM renders from other members (or one the body cannot size)
HIDDEN_PROMPTS = [
    ("/v1/chat/completions", TINY_CHAT | {"tools": [TOOL]}),
    ("/v1/chat/completions", TINY_CHAT | {"documents": [{"title": "t", "text": BULK}]}),
    ("/v1/chat/completions", TINY_CHAT | {"chat_template_kwargs": {"context": BULK}}),
    ("/v1/chat/completions", TINY_CHAT | {"chat_template": "{{ messages[0].content }}"}),
    ("/v1/completions", SHORT | {"prompt": "hi", "prompt_embeds": BULK}),
]


@pytest.mark.parametrize(
    "decision", [{"mode": "threshold", "max_prompt_tokens": 64}, {"mode": "load_aware"}]
)
async def test_a_prompt_outside_the_messages_is_measured(decision: dict[str, Any]) -> None:
    async with topology(decision=decision) as topo:
        async with held_streams(topo, 1):  # D runs a request: a 50k-token prefill would stall it
            status, payload, _ = await topo.post("/v1/chat/completions", TINY_CHAT)
            assert status == 200, payload
            for path, body in HIDDEN_PROMPTS:
                status, payload, _ = await topo.post(path, body)
                assert status == 200, payload
        # the held stream and the tiny chat alone; every hidden prompt through P
        assert await was_disaggregated(topo) == [False, False] + [True] * len(HIDDEN_PROMPTS)
        assert len(await topo.seen(topo.prefills[0])) == len(HIDDEN_PROMPTS)
        metrics = await topo.metrics()
        assert metrics[decisions("disaggregate", "unbounded_prompt")] == 1  # chat_template


async def test_deliberate_decode_only_raises_no_recompute_alert() -> None:
    # Short prompts computed by D on purpose outweigh the one disaggregated prompt in the
    # window: counted as recomputation, the share would fall below min_share.
    async with topology(
        decision={"mode": "threshold", "max_prompt_tokens": 100},
        kv_check={"interval_s": 2.0},
    ) as topo:
        d = address(topo.decodes[0])
        share = f'pd_extproc_decode_kv_transfer_share{{endpoint="{d}"}}'
        medium = {"model": MODEL, "prompt": "lorem ipsum dolor " * 20, "max_tokens": 2}
        status, _, _ = await topo.post("/v1/completions", LONG | {"prompt": "word " * 150})
        assert status == 200
        for _ in range(8):
            status, _, _ = await topo.post("/v1/completions", medium)
            assert status == 200
        assert await was_disaggregated(topo) == [True] + [False] * 8

        local = f'pd_extproc_decode_prompt_tokens{{endpoint="{d}",source="local_compute"}}'
        engine = await scrape(topo.session, topo.decodes[0].url + "/metrics")
        computed = sum(
            v
            for k, v in engine.items()
            if k.startswith("vllm:prompt_tokens_by_source_total") and 'source="local_compute"' in k
        )
        assert computed > 0

        async def judged() -> bool:  # a window closed after every request was counted
            return (await topo.metrics()).get(local) == computed

        await until(judged, "a KV check window with the requests", timeout_s=10)
        metrics = await topo.metrics()
        assert metrics[share] == 1.0
        assert not any(k.startswith("pd_extproc_pd_recompute_alerts_total") for k in metrics)
        assert "computed" not in topo.sidecar.log_text()


# ---- admission control ---------------------------------------------------------------------

ADMISSION = {"enabled": True, "decode": {"max_in_flight": 4}}
GATEWAY_PRIORITY = "x-gateway-priority"  # what the gateway in front sets (this test is it)
BY_GATEWAY = ADMISSION | {"priority_header": GATEWAY_PRIORITY}


async def post_with_priority(
    topo: Topology, priority: str | None, header: str = GATEWAY_PRIORITY
) -> tuple[int, bytes, Any]:
    headers = {} if priority is None else {header: priority}
    return await topo.post("/v1/completions", SHORT, headers=headers)


async def test_saturated_pool_answers_429_with_retry_after() -> None:
    async with topology(admission=ADMISSION | {"retry_after_s": 2}) as topo:
        async with held_streams(topo, 4):
            status, body, headers = await post_with_priority(topo, None)
            assert status == 429, body
            assert headers.get("retry-after") == "2"
            error = orjson.loads(body)["error"]
            assert error["code"] == 429 and error["type"] == "RateLimitError"
            assert "saturated" in error["message"]
        status, body, _ = await post_with_priority(topo, None)  # room again
        assert status == 200, body
        metrics = await topo.metrics()
        assert metrics[requests_total("shed", "none", "none")] == 1


async def test_a_client_cannot_raise_or_lower_its_own_priority() -> None:
    """No header is trusted by default: a client's x-request-priority changes nothing."""
    async with topology(admission=ADMISSION) as topo:
        for value in ("-4", "-100", "high"):  # idle engines admit every request
            status, body, _ = await post_with_priority(topo, value, "x-request-priority")
            assert status == 200, body
        async with held_streams(topo, 4, {"x-request-priority": "100"}):
            for value in ("100", "1_000", "1", None):  # at the limit: shed like anyone else
                status, body, _ = await post_with_priority(topo, value, "x-request-priority")
                assert status == 429, (value, body)
            ready = await topo.ready()
            assert [d["in_flight"] for d in ready["decode"].values()] == [4]


async def test_lower_priorities_are_shed_first() -> None:
    async with topology(admission=BY_GATEWAY) as topo:
        shed_at: dict[int, set[str]] = {}
        for held in (1, 2, 3, 4):  # saturation 25 %, 50 %, 75 %, 100 %
            async with held_streams(topo, held):
                for priority in ("-3", "-2", "-1", "0"):
                    status, body, _ = await post_with_priority(topo, priority)
                    assert status in (200, 429), body
                    if status == 429:
                        shed_at.setdefault(held, set()).add(priority)
            await topo.released()
        assert shed_at == {
            1: {"-3"},
            2: {"-3", "-2"},
            3: {"-3", "-2", "-1"},
            4: {"-3", "-2", "-1", "0"},
        }


async def test_the_gateways_priority_is_bounded_and_strictly_parsed() -> None:
    async with topology(admission=BY_GATEWAY | {"priority_default": -1}) as topo:
        status, body, _ = await post_with_priority(topo, "-4")  # clamped to -3: idle admits
        assert status == 200, body
        async with held_streams(topo, 3):  # 75 %: -1 (the default) is shed, 0 is not
            status, body, _ = await post_with_priority(topo, "0")
            assert status == 200, body
            for value in ("1_000", "٣", "+5", None):  # the default
                status, body, _ = await post_with_priority(topo, value)
                assert status == 429, (value, body)
        async with held_streams(topo, 4, {GATEWAY_PRIORITY: "0"}):
            status, body, _ = await post_with_priority(topo, "100")  # clamped to the top: 100 %
            assert status == 429, body
        metrics = await topo.metrics()
        assert metrics["pd_extproc_invalid_priorities_total"] == 3


async def test_a_saturated_prefill_pool_sheds_only_requests_that_need_p() -> None:
    admission = {"enabled": True, "prefill": {"max_in_flight": 1}}
    decision = {"mode": "threshold", "max_prompt_tokens": 64}
    async with topology(admission=admission, decision=decision) as topo:
        # P's one slot is taken while a P leg runs (a P leg answers after 2 s)
        await topo.sim(topo.prefills[0], "POST", "/sim/faults", {"latency_ms": 2000})
        first = asyncio.create_task(topo.post("/v1/completions", LONG))
        try:

            async def prefill_busy() -> bool:
                prefills = (await topo.ready())["prefill"].values()
                return [p["in_flight"] for p in prefills] == [1]

            await until(prefill_busy, "the first request's P leg")
            status, body, _ = await topo.post("/v1/completions", LONG)
            assert status == 429, body
            assert "the prefill engines are saturated" in orjson.loads(body)["error"]["message"]
            status, body, _ = await topo.post("/v1/completions", SHORT)  # D alone: no P needed
            assert status == 200, body
        finally:
            status, body, _ = await asyncio.wait_for(first, 30)
        assert status == 200, body
        metrics = await topo.metrics()
        assert metrics[requests_total("ok", "short_prompt", "decode_only")] == 1


# ---- prefill retry -------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "connectors"), [("serial_push", PUSH), ("pull", PULL)])
async def test_serial_prefill_answering_503_is_retried_on_another(
    mode: str, connectors: tuple[str, str]
) -> None:
    async with topology(2, 1, connectors, dispatch={"mode": mode}) as topo:
        busy, other = topo.prefills
        await topo.sim(busy, "POST", "/sim/faults", {"fail_next": 1, "fail_status": 503})

        async def fault_used() -> bool:
            return (await topo.sim(busy, "GET", "/sim/faults"))["fail_next"] == 0

        for _ in range(4):  # round robin: the busy P gets one of the first two
            status, body, _ = await topo.post("/v1/completions", SHORT)
            assert status == 200, body
            if await fault_used():
                break
        assert await fault_used()
        [failed] = [r for r in await topo.seen(busy) if r["status"] == 503]
        retried = [r for r in await topo.seen(other) if r["x_request_id"] == failed["x_request_id"]]
        assert len(retried) == 1 and retried[0]["status"] == 200
        metrics = await topo.metrics()
        assert metrics['pd_extproc_prefill_retries_total{reason="busy"}'] == 1


async def test_parallel_dispatch_does_not_retry() -> None:
    async with topology(2, 1, dispatch={"mode": "push"}) as topo:
        for prefill in topo.prefills:
            await topo.sim(prefill, "POST", "/sim/faults", {"fail_next": 1, "fail_status": 503})
        status, _, _ = await topo.post("/v1/completions", SHORT)
        assert status == 502
        asked = [r for p in topo.prefills for r in await topo.seen(p)]
        assert len(asked) == 1
