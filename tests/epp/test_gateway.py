"""pd-extproc as the endpoint picker of a pool behind a GIE-style gateway Envoy (both route
cluster variants), with vllmsim prefill and decode engines."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from tests.support.engines import MODEL, PULL, address
from tests.support.epp import GatewayTopology, epp_topology
from tests.support.gateway import SUBSET_TEST_HEADER, Variant
from tests.support.legs import assert_sent_together, held_prefills
from tests.support.topology import generated_text

COMPLETION = {"model": MODEL, "prompt": "Tell me a story " * 20, "max_tokens": 8}
# ORIGINAL_DST reads one address from the header: a list of fallbacks does not parse there.
FALLBACKS = {Variant.ORIGINAL_DST: 0, Variant.OVERRIDE_HOST: 1}
VARIANTS = pytest.mark.parametrize("variant", list(Variant))


def picker_settings(variant: Variant) -> dict[str, Any]:
    return {"endpoint_picker": {"fallbacks": FALLBACKS[variant]}}


async def legs(topo: GatewayTopology) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(P record, D record) of each user request, oldest first; each record gains the engine
    id and address of the engine that received it (`engine_id`, `engine`)."""
    prefill_seen = {
        r["x_request_id"]: r | {"engine_id": e.engine_id, "engine": address(e)}
        for e in topo.prefills
        for r in await topo.seen(e)
    }
    pairs = [
        (prefill_seen[r["x_request_id"]], r | {"engine": address(e)})
        for e in topo.decodes
        for r in await topo.seen(e)
    ]
    return sorted(pairs, key=lambda pair: pair[1]["received_at"])


@pytest.fixture(scope="module", params=list(Variant))
async def push_2p2d(request: pytest.FixtureRequest) -> AsyncIterator[GatewayTopology]:
    variant: Variant = request.param
    async with epp_topology(variant, 2, 2, **picker_settings(variant)) as topo:
        yield topo


async def test_push_parallel_legs_reach_the_engines_together(push_2p2d: GatewayTopology) -> None:
    topo = push_2p2d
    await topo.clear()
    async with held_prefills(topo):
        for _ in range(6):
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
    pairs = await legs(topo)
    assert len(pairs) == 6
    for p, d in pairs:
        assert d["kv_evidence"]["engine_ids"] == [p["engine_id"]]  # D's KV came from its P
        assert d["kv"] == "push-parallel"
        assert_sent_together(p, d)


async def test_decode_gets_an_exact_content_length(push_2p2d: GatewayTopology) -> None:
    topo = push_2p2d
    await topo.clear()
    status, body, _ = await topo.post("/v1/completions", COMPLETION)
    assert status == 200, body
    [(_, d)] = await legs(topo)
    assert "transfer-encoding" not in d["headers"]
    assert int(d["headers"]["content-length"]) == d["body_bytes"]


async def test_subset_hint_is_honoured_for_both_legs(push_2p2d: GatewayTopology) -> None:
    topo = push_2p2d
    await topo.clear()
    allowed = [address(topo.prefills[1]), address(topo.decodes[1])]
    for _ in range(6):
        status, body, _ = await topo.post(
            "/v1/completions", COMPLETION, {SUBSET_TEST_HEADER: ",".join(allowed)}
        )
        assert status == 200, body
    assert await topo.seen(topo.prefills[0]) == []
    assert await topo.seen(topo.decodes[0]) == []
    assert len(await topo.seen(topo.decodes[1])) == 6


async def test_nothing_in_the_subset_can_serve_gives_503(push_2p2d: GatewayTopology) -> None:
    topo = push_2p2d
    await topo.clear()
    only_prefills = ",".join(address(e) for e in topo.prefills)  # no decode among them
    status, body, headers = await topo.post(
        "/v1/completions", COMPLETION, {SUBSET_TEST_HEADER: only_prefills}
    )
    assert status == 503, body
    assert headers["content-type"] == "application/json"
    error = orjson.loads(body)["error"]
    assert "subset hint" in error["message"] and error["code"] == 503
    assert all([await topo.seen(e) == [] for e in topo.engines])


async def test_client_routing_header_and_kv_params_never_reach_an_engine(
    push_2p2d: GatewayTopology,
) -> None:
    topo = push_2p2d
    await topo.clear()
    spoofed = "127.0.0.1:1"  # nothing listens there: routed by it, the request would fail
    bogus = {"do_remote_prefill": True, "remote_engine_id": "spoofed", "remote_block_ids": [7]}
    for _ in range(4):
        status, body, _ = await topo.post(
            "/v1/completions",
            {**COMPLETION, "kv_transfer_params": bogus},
            {"x-gateway-destination-endpoint": spoofed},
        )
        assert status == 200, body
    for p, d in await legs(topo):
        assert "x-gateway-destination-endpoint" not in p["headers"]  # P: straight, unrouted
        routed = d["headers"]["x-gateway-destination-endpoint"].split(",")
        assert routed[0] == d["engine"] and spoofed not in routed
        for record in (p, d):
            assert "spoofed" not in orjson.dumps(record["body"]).decode()
            # one kv_transfer_params member, not the client's beside ours (a parser keeping the
            # first would take the client's): the compact body is exactly its parsed form
            assert record["body_bytes"] == len(orjson.dumps(record["body"]))
        assert d["kv"] == "push-parallel"


async def test_a_body_over_the_limit_gets_413_before_any_leg_leaves() -> None:
    variant = Variant.OVERRIDE_HOST
    limits = {"limits": {"max_body_bytes": 4096}}
    async with epp_topology(variant, **picker_settings(variant), **limits) as topo:
        big = {**COMPLETION, "prompt": "x" * 10_000}
        status, body, _ = await topo.post("/v1/completions", big)
        assert status == 413, body
        assert orjson.loads(body)["error"]["code"] == 413
        assert all([await topo.seen(e) == [] for e in topo.engines])
        status, body, _ = await topo.post("/v1/completions", COMPLETION)  # under it: served
        assert status == 200, body


@VARIANTS
async def test_pull_is_served_serially(variant: Variant) -> None:
    async with epp_topology(variant, connectors=PULL, **picker_settings(variant)) as topo:
        for _ in range(3):
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
        pairs = await legs(topo)
        assert len(pairs) == 3
        for p, d in pairs:
            assert d["kv"] == "pull"
            assert d["kv_evidence"]["engine_ids"] == [topo.prefills[0].engine_id]
            assert d["received_at"] > p["received_at"]
            assert d["body"]["kv_transfer_params"]["transfer_mode"] == "pull"


async def test_a_streamed_answer_passes_through_the_picker(push_2p2d: GatewayTopology) -> None:
    """The gateway streams D's answer through the picker (FULL_DUPLEX_STREAMED response)."""
    topo = push_2p2d
    await topo.clear()
    status, body, headers = await topo.post("/v1/completions", {**COMPLETION, "stream": True})
    assert status == 200, body
    assert headers["content-type"].startswith("text/event-stream")
    assert body.endswith(b"data: [DONE]\n\n")
    assert generated_text("/v1/completions", body)
    [(_, d)] = await legs(topo)
    assert d["kv"] == "push-parallel"


async def test_engine_endpoints_pass_through_and_other_paths_are_refused(
    push_2p2d: GatewayTopology,
) -> None:
    topo = push_2p2d
    async with topo.session.get(topo.url + "/v1/models") as response:
        assert response.status == 200
        assert (await response.json())["data"][0]["id"] == MODEL
    status, body, _ = await topo.post("/tokenize", {"model": MODEL, "prompt": "hello world"})
    assert status == 200, body
    assert orjson.loads(body)["count"] > 0
    async with topo.session.get(topo.url + "/v1/secrets") as response:
        assert response.status == 404
        assert (await response.json())["error"]["code"] == 404


async def test_original_dst_cannot_take_a_fallback_list() -> None:
    """Why `fallbacks: 0` behind an ORIGINAL_DST cluster: Envoy cannot parse a list there."""
    async with epp_topology(Variant.ORIGINAL_DST, 1, 2, endpoint_picker={"fallbacks": 1}) as topo:
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 503 and b"no healthy upstream" in body, body


async def test_a_prefill_longer_than_the_gateways_message_timeout_is_served() -> None:
    """The gateway times ext_proc messages at 5 s; D's headers wait for a 6 s P meanwhile."""
    variant = Variant.OVERRIDE_HOST
    slow = ("--prefill-per-token-ms", "75")  # about 80 prompt tokens: 6 s
    async with epp_topology(
        variant, engine_flags=slow, timeouts={"probe_s": 30}, **picker_settings(variant)
    ) as topo:
        status, body, _ = await topo.post("/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200, body
        assert body.endswith(b"data: [DONE]\n\n")
        [(p, d)] = await legs(topo)
        assert d["kv"] == "push-parallel"
        assert d["first_token_at"] - p["received_at"] > 5


async def test_sigterm_lets_an_open_streamed_answer_finish() -> None:
    variant, slow = Variant.OVERRIDE_HOST, ("--step-base-ms", "40")
    settings = picker_settings(variant) | {"timeouts": {"drain_s": 10}}
    async with epp_topology(variant, engine_flags=slow, **settings) as topo:
        body = orjson.dumps({**COMPLETION, "max_tokens": 40, "stream": True})
        headers = {"content-type": "application/json"}
        async with topo.session.post(
            topo.url + "/v1/completions", data=body, headers=headers
        ) as response:
            events = [await response.content.readline()]
            os.kill(topo.picker.pid, signal.SIGTERM)
            async for line in response.content:
                events.append(line)
        assert b"data: [DONE]\n" in events  # the open stream finished whole
        assert len([e for e in events if e.startswith(b"data: {")]) >= 40


async def test_a_passed_through_request_carries_no_routing_header_of_the_client(
    push_2p2d: GatewayTopology,
) -> None:
    """The picker passes /tokenize through untouched, but the headers the sidecar owns (the
    data-parallel rank, in any case, and Envoy's local-reply flags) never reach the engine."""
    topo = push_2p2d
    await topo.clear()
    owned = {"X-Data-Parallel-Rank": "1", "x-pd-extproc-envoy-flags": "UF"}
    status, body, _ = await topo.post(
        "/tokenize", {"model": MODEL, "prompt": "hello world"}, headers=owned | {"x-kept": "1"}
    )
    assert status == 200, body
    [record] = [r for e in topo.decodes for r in await topo.seen(e)]
    assert record["path"] == "/tokenize" and record["body"]["prompt"] == "hello world"
    assert record["headers"]["x-kept"] == "1"  # the client's other headers pass
    assert not {name.lower() for name in owned} & set(record["headers"]), record["headers"]


async def test_a_passed_through_request_is_admitted_at_the_requests_priority() -> None:
    """Admission treats a passed-through request as any other: the default priority (-1 here,
    shed at 50 % of the limits), or the gateway's trusted header's value."""
    admission = {
        "enabled": True,
        "decode": {"max_in_flight": 2},
        "priority_header": "x-gateway-priority",
        "priority_min": -1,
        "priority_max": 0,
        "priority_default": -1,
        "priority_step": 0.5,
    }
    variant = Variant.OVERRIDE_HOST
    tokenize = {"model": MODEL, "prompt": "hello world"}
    async with epp_topology(variant, admission=admission, **picker_settings(variant)) as topo:
        status, body, _ = await topo.post("/tokenize", tokenize)  # idle: admitted
        assert status == 200, body
        held = {**COMPLETION, "max_tokens": 2000, "stream": True}
        async with topo.session.post(topo.url + "/v1/completions", json=held) as stream:
            assert stream.status == 200, await stream.text()
            await asyncio.wait_for(stream.content.readline(), 10)  # D at 1 of 2: 50 %
            for headers in ({}, {"x-gateway-priority": "-5"}, {"x-gateway-priority": "٣"}):
                status, body, response_headers = await topo.post("/tokenize", tokenize, headers)
                assert status == 429, (headers, body)
                assert response_headers["retry-after"] == "1"
            status, body, _ = await topo.post("/tokenize", tokenize, {"x-gateway-priority": "0"})
            assert status == 200, body
            async with topo.session.get(topo.url + "/v1/models") as response:
                assert response.status == 429
