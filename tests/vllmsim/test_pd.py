"""Prefill/decode flows between two real vllmsim processes: pull, push serial/parallel,
identity errors, leases, disconnects."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.vllmsim.vsim_helpers import (
    IDENTITY_KEYS,
    PROMPT,
    d_body,
    eventually,
    get_json,
    identity,
    metric,
    p_body,
    post,
    record,
)
from vllmsim.launcher import FAST, PULL_D, PULL_P, PUSH_D, PUSH_P, EngineHandle, running_engine

# Key order of vLLM 0.33's prefill kv_transfer_params (push) and the pull additions.
PUSH_KEYS = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "transfer_mode",
    "remote_prefill_cached_tokens",
]
PULL_KEYS = [
    *PUSH_KEYS[:-2],
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_registration_generation",
    "remote_prefill_cached_tokens",
]
INTERNAL_ERROR = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


async def stream_text(
    http: aiohttp.ClientSession, eng: EngineHandle, body: dict[str, Any], rid: str
) -> str:
    async with http.post(
        eng.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}
    ) as resp:
        assert resp.status == 200
        raw = await resp.read()
    chunks = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert "kv_transfer_params" not in chunks[-2]  # D has no params to return: key absent
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


async def reference_text(http: aiohttp.ClientSession, eng: EngineHandle) -> str:
    _, body = await post(http, eng, "/v1/completions", d_body(None))
    return body["choices"][0]["text"]


async def test_prefill_response_shape(http: aiohttp.ClientSession) -> None:
    for cfg, keys, mode in ((PUSH_P, PUSH_KEYS, "push"), (PULL_P, PULL_KEYS, "pull")):
        async with running_engine(*FAST, "--kv-transfer-config", cfg) as p:
            status, body = await post(http, p, "/v1/completions", p_body(), rid="shape")
            assert status == 200
            params = body["kv_transfer_params"]
            assert list(params) == keys
            rec = await record(http, p, "shape")
            assert params["remote_request_id"] == rec["internal_id"] and rec["kv"] == "prefill"
            assert params["remote_engine_id"] == p.engine_id
            assert params["remote_port"] == p.side_channel_port
            assert params["remote_host"] == "127.0.0.1" and params["transfer_mode"] == mode
            assert params["remote_num_tokens"] == body["usage"]["prompt_tokens"]
            assert len(params["remote_block_ids"][0]) == -(
                -(body["usage"]["prompt_tokens"] + 1) // 16
            )
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 1
            state = await get_json(http, p, "/sim/state")
            assert state["leases"] == len(params["remote_block_ids"][0]) == state["blocks_used"]


async def test_pull_flow(http: aiohttp.ClientSession) -> None:
    async with (
        running_engine(*FAST, "--kv-transfer-config", PULL_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PULL_D) as d,
    ):
        _, pr = await post(http, p, "/v1/completions", p_body(), rid="pull-1")
        text = await stream_text(http, d, d_body(pr["kv_transfer_params"], stream=True), "pull-1")
        assert text == await reference_text(http, p)  # disaggregated == aggregated
        assert (await record(http, d, "pull-1"))["kv"] == "pull"
        assert (await get_json(http, p, "/sim/state"))["leases"] == 0  # READ done: released
        assert (await get_json(http, d, "/sim/state"))["blocks_used"] == 0
        prompt_tokens = pr["usage"]["prompt_tokens"]
        assert (
            await metric(
                http, d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
            )
            == prompt_tokens
        )
        assert await metric(http, p, "vllm:nixl_bytes_transferred_total") > 0
        # Missing keys on a pull D: "Got invalid KVTransferParams", recompute locally.
        bad = {"do_remote_prefill": True, "remote_engine_id": p.engine_id}
        status, _ = await post(http, d, "/v1/completions", d_body(bad), rid="pull-bad")
        assert status == 200 and (await record(http, d, "pull-bad"))["kv"] == "recompute"


async def test_push_serial(http: aiohttp.ClientSession) -> None:
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        _, pr = await post(http, p, "/v1/completions", p_body(), rid="serial-1")
        text = await stream_text(http, d, d_body(pr["kv_transfer_params"], stream=True), "serial-1")
        assert text == await reference_text(http, p)
        assert (await record(http, d, "serial-1"))["kv"] == "push-serial"
        assert (await get_json(http, p, "/sim/state"))["leases"] == 0
        assert (await get_json(http, d, "/sim/state"))["blocks_used"] == 0
        assert await metric(http, p, "vllm:nixl_num_kv_expired_reqs_total") == 0


async def test_push_parallel_registers_during_prefill(http: aiohttp.ClientSession) -> None:
    slow_prefill = ("--step-base-ms", "1", "--prefill-per-token-ms", "1")  # ~100 ms prefill
    async with (
        running_engine(*slow_prefill, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        params = identity(p, "placeholder-uuid")
        p_leg = post(http, p, "/v1/completions", p_body(), rid="par-1")
        d_leg = stream_text(http, d, d_body(params, stream=True), "par-1")
        (status, pr), text = await asyncio.gather(p_leg, d_leg)
        assert status == 200
        assert all(pr["kv_transfer_params"][k] == params[k] for k in IDENTITY_KEYS)
        assert (await record(http, d, "par-1"))["kv"] == "push-parallel"
        assert text == await reference_text(http, d)
        assert (await get_json(http, p, "/sim/state"))["leases"] == 0


async def test_push_transfer_id_pairs_legs(http: aiohttp.ClientSession) -> None:
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        # Different X-Request-Ids: only the shared transfer_id can pair them.
        _, pr = await post(
            http,
            p,
            "/v1/completions",
            p_body(kv_transfer_params={"do_remote_decode": True, "transfer_id": "xfer-1"}),
            rid="tp",
        )
        params = {**pr["kv_transfer_params"], "transfer_id": "xfer-1"}
        status, _ = await post(http, d, "/v1/completions", d_body(params), rid="td")
        assert status == 200 and (await record(http, d, "td"))["kv"] == "push-serial"


async def test_push_wrong_engine_id(http: aiohttp.ClientSession) -> None:
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        stale = {**identity(p, "x"), "remote_engine_id": "stale-engine"}
        status, body = await post(http, d, "/v1/completions", d_body(stale), rid="stale")
        assert status == 500 and body == INTERNAL_ERROR
        async with http.post(d.url + "/v1/completions", json=d_body(stale, stream=True)) as resp:
            assert resp.status == 200
            raw = await resp.read()
        # vLLM writes this one event with json.dumps' default separators
        assert raw == b"data: " + json.dumps(INTERNAL_ERROR).encode() + b"\n\ndata: [DONE]\n\n"
        assert (await get_json(http, d, "/sim/state"))["blocks_used"] == 0


async def test_push_missing_key_is_engine_dead_error(http: aiohttp.ClientSession) -> None:
    """vLLM's EngineCore dies on it: 500, or 200 then an error event when streamed."""
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        for key in (
            "remote_engine_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "remote_request_id",
        ):
            params = identity(p, "x")
            del params[key]
            status, body = await post(http, d, "/v1/completions", d_body(params))
            assert status == 500 and body == ENGINE_DEAD, key
        async with http.post(d.url + "/v1/completions", json=d_body(params, stream=True)) as resp:
            assert resp.status == 200
            raw = await resp.read()
        assert raw == b"data: " + json.dumps(ENGINE_DEAD).encode() + b"\n\ndata: [DONE]\n\n"
        assert "would crash" in d.log_text()


async def test_kv_transfer_params_not_an_object_is_400(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d:
        status, body = await post(http, d, "/v1/completions", d_body("nope"))
    assert status == 400
    assert body["error"] == {
        "message": "1 validation error:\n  {'type': 'dict_type', 'loc': 'body.kv_transfer_params',"
        " 'msg': 'Input should be a valid dictionary', 'input': 'nope'}",
        "type": "Bad Request",
        "param": "body.kv_transfer_params",
        "code": 400,
    }


async def test_lease_expiry_frees_blocks(http: aiohttp.ClientSession) -> None:
    cfg = json.dumps(
        {
            "kv_connector": "NixlPushConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"kv_lease_duration": 0.3},
        }
    )
    async with running_engine(*FAST, "--kv-transfer-config", cfg) as p:
        await post(http, p, "/v1/completions", p_body(), rid="lease")
        state = await get_json(http, p, "/sim/state")
        assert state["leases"] > 0 and state["blocks_used"] == state["leases"]

        async def freed() -> bool:
            return (await get_json(http, p, "/sim/state"))["blocks_used"] == 0

        await eventually(freed, within=5)
        assert await metric(http, p, "vllm:nixl_num_kv_expired_reqs_total") == 1
        assert "Releasing expired KV blocks" in p.log_text()


async def test_client_disconnect_frees_d_blocks(http: aiohttp.ClientSession) -> None:
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        # D registers for a P request that never comes: it waits with no timeout.
        task = asyncio.create_task(
            post(http, d, "/v1/completions", d_body(identity(p, "y")), rid="orphan")
        )

        async def parked() -> bool:
            state = await get_json(http, d, "/sim/state")
            return state["waiting"] == 1 and state["blocks_used"] > 0

        await eventually(parked)
        assert (
            await metric(http, d, "vllm:num_requests_kv_fetch_by_stage", stage="in_progress") == 1
        )
        assert await metric(http, d, "vllm:num_requests_waiting_by_reason", reason="deferred") == 1
        task.cancel()  # the client goes away

        async def freed() -> bool:
            state = await get_json(http, d, "/sim/state")
            return state["blocks_used"] == 0 and state["waiting"] == 0

        await eventually(freed)
        assert (await record(http, d, "orphan"))["outcome"] == "aborted"


async def test_chat_push_parallel_and_path_mismatch(http: aiohttp.ClientSession) -> None:
    slow_prefill = ("--step-base-ms", "1", "--prefill-per-token-ms", "2")
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}]}
    async with (
        running_engine(*slow_prefill, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        p_leg = post(
            http,
            p,
            "/v1/chat/completions",
            {**chat, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            rid="chat-1",
        )
        d_leg = post(
            http,
            d,
            "/v1/chat/completions",
            {**chat, "max_tokens": 4, "kv_transfer_params": identity(p, "c")},
            rid="chat-1",
        )
        (ps, pr), (ds, dr) = await asyncio.gather(p_leg, d_leg)
        assert ps == ds == 200 and dr["kv_transfer_params"] is None
        assert pr["id"] == dr["id"] == "chatcmpl-chat-1"
        assert (await record(http, d, "chat-1"))["kv"] == "push-parallel"
        # Same X-Request-Id but different paths never pair (cmpl-... vs chatcmpl-...).
        d_task = asyncio.create_task(
            post(
                http,
                d,
                "/v1/chat/completions",
                {**chat, "max_tokens": 2, "kv_transfer_params": identity(p, "m")},
                rid="mix",
            )
        )
        await post(http, p, "/v1/completions", p_body(), rid="mix")
        done, _ = await asyncio.wait({d_task}, timeout=0.5)
        assert not done, "a chat D leg must not pair with a completions P leg"
        d_task.cancel()


@pytest.mark.parametrize("port", ["not-a-port", 1.5, True])
async def test_push_port_that_is_no_number_fails_the_request(
    http: aiohttp.ClientSession, port: object
) -> None:
    """The transfer fails as a stale engine id does; D never waits for ever."""
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        params = {**identity(p, "x"), "remote_port": port}
        status, body = await asyncio.wait_for(post(http, d, "/v1/completions", d_body(params)), 10)
        assert status == 500 and body == INTERNAL_ERROR
