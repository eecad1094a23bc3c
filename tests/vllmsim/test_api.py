"""HTTP API of one aggregated engine: ids, shapes, SSE bytes, errors, small endpoints."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import aiohttp
import pytest

from tests.vllmsim.vsim_helpers import PROMPT, get_json, metric, post
from vllmsim.launcher import FAST, EngineHandle, running_engine, running_engine_sync


@pytest.fixture(scope="module")
def eng() -> Iterator[EngineHandle]:
    # One engine for the module; the sync helper keeps it independent of event loops.
    with running_engine_sync(*FAST, "--served-model-name", "sim-model", "alias") as handle:
        yield handle


async def _records(http: aiohttp.ClientSession, eng: EngineHandle) -> list[dict]:
    return await get_json(http, eng, "/sim/requests")


async def test_completion_ids_follow_vllm(http: aiohttp.ClientSession, eng: EngineHandle) -> None:
    status, body = await post(
        http, eng, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, rid="req-1"
    )
    assert status == 200 and body["id"] == "cmpl-req-1"
    status, body = await post(
        http,
        eng,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        rid="req-1",
    )
    assert status == 200 and body["id"] == "chatcmpl-req-1"
    status, body = await post(
        http, eng, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "request_id": "from-body"}
    )
    assert body["id"] == "cmpl-from-body"
    recs = [r for r in await _records(http, eng) if r["x_request_id"] in ("req-1", None)][-3:]
    assert re.fullmatch(r"cmpl-req-1-0-[0-9a-f]{8}", recs[0]["internal_id"])
    assert re.fullmatch(r"chatcmpl-req-1-[0-9a-f]{8}", recs[1]["internal_id"])
    assert re.fullmatch(r"cmpl-from-body-0-[0-9a-f]{8}", recs[2]["internal_id"])
    assert recs[0]["outcome"] == "ok" and recs[0]["status"] == 200 and recs[0]["kv"] == "local"
    assert recs[0]["headers"]["x-request-id"] == "req-1"
    assert recs[0]["received_at"] <= recs[0]["first_token_at"]


async def test_same_x_request_id_gets_a_fresh_suffix(
    http: aiohttp.ClientSession, eng: EngineHandle
) -> None:
    for _ in range(2):
        await post(http, eng, "/v1/completions", {"prompt": "x", "max_tokens": 1}, rid="dup")
    ids = [r["internal_id"] for r in await _records(http, eng) if r["x_request_id"] == "dup"]
    assert len(ids) == 2 and ids[0] != ids[1]


async def test_non_stream_shapes(http: aiohttp.ClientSession, eng: EngineHandle) -> None:
    _, body = await post(http, eng, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    # Key order as real vLLM 0.32 (tests/real_vllm/test_contract.py checks the key sets).
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert list(body["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    ]
    assert body["usage"] == {
        "prompt_tokens": body["usage"]["prompt_tokens"],
        "total_tokens": body["usage"]["prompt_tokens"] + 3,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert body["kv_transfer_params"] is None and body["choices"][0]["finish_reason"] == "length"
    _, chat = await post(
        http,
        eng,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 2,
            "model": "alias",
        },
    )
    assert list(chat) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
    ]
    assert chat["object"] == "chat.completion" and chat["model"] == "alias"
    assert "tool_calls" not in chat["choices"][0]["message"]
    assert chat["choices"][0]["message"]["reasoning"] is None
    assert chat["usage"]["completion_tokens"] == 2


async def test_output_is_deterministic(http: aiohttp.ClientSession, eng: EngineHandle) -> None:
    _, a = await post(http, eng, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
    _, b = await post(http, eng, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
    _, c = await post(http, eng, "/v1/completions", {"prompt": PROMPT + "!", "max_tokens": 5})
    assert a["choices"][0]["text"] == b["choices"][0]["text"] != c["choices"][0]["text"]


async def _sse(
    http: aiohttp.ClientSession, eng: EngineHandle, path: str, body: dict
) -> tuple[str, bytes]:
    async with http.post(eng.url + path, json=body) as resp:
        assert resp.status == 200
        return resp.headers["Content-Type"], await resp.read()


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"data: [DONE]\n\n")
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    for part in parts[:-1]:
        assert part.startswith(b"data: ") and b"\n" not in part
    return [p[len(b"data: ") :] for p in parts[:-2]]


async def test_completion_stream_bytes(http: aiohttp.ClientSession, eng: EngineHandle) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    ctype, raw = await _sse(http, eng, "/v1/completions", body)
    assert ctype == "text/event-stream; charset=utf-8"
    events = _events(raw)
    chunks = [json.loads(e) for e in events]
    for event, chunk in zip(events, chunks, strict=True):  # compact, like model_dump_json
        assert event == json.dumps(chunk, separators=(",", ":")).encode()
    assert len(chunks) == 4
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    # vLLM sends kv_transfer_params only when set, and no "usage": null in content chunks.
    assert all("kv_transfer_params" not in c and "usage" not in c for c in chunks[:3])
    assert "system_fingerprint" in chunks[3] and "system_fingerprint" not in chunks[2]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 3
    _, whole = await post(http, eng, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert "".join(c["choices"][0]["text"] for c in chunks[:3]) == whole["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_streamed_token_leaves_in_the_step_that_made_it(
    http: aiohttp.ClientSession, path: str
) -> None:
    """As vLLM's API server: the first token reaches the client before the engine has made the
    second one (a stream that held each token back for the next would add a decode step to
    every TTFT). Each step takes 400 ms, so the client has read the first chunk and scraped
    /metrics long before the second step ends."""
    async with running_engine("--step-base-ms", "400", "--prefill-per-token-ms", "0") as slow:
        chat = path.endswith("chat/completions")
        prompt = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
        body = {**prompt, "max_tokens": 3, "stream": True}
        async with http.post(slow.url + path, json=body) as resp:
            async for line in resp.content:
                chunk = json.loads(line[len(b"data: ") :]) if line.startswith(b"data: {") else {}
                delta = chunk.get("choices", [{}])[0]
                if delta.get("text") or delta.get("delta", {}).get("content"):
                    break
            made = await metric(http, slow, "vllm:generation_tokens_total")
            assert made == 1, "the first token left only after the engine made another"
            assert delta["finish_reason"] is None


async def test_chat_stream_bytes(http: aiohttp.ClientSession, eng: EngineHandle) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    _, raw = await _sse(http, eng, "/v1/chat/completions", body)
    chunks = [json.loads(e) for e in _events(raw)]
    assert raw.startswith(b'data: {"id":"chatcmpl-')
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:3]] == [None, "length"]
    assert "kv_transfer_params" not in chunks[2]
    assert chunks[3] == {**chunks[3], "choices": [], "usage": chunks[3]["usage"]}
    assert chunks[3]["usage"]["total_tokens"] == chunks[3]["usage"]["prompt_tokens"] + 2
    # Without include_usage: no usage chunk.
    _, raw = await _sse(http, eng, "/v1/chat/completions", {**body, "stream_options": None})
    chunks = [json.loads(e) for e in _events(raw)]
    assert all(c["choices"] for c in chunks)
    assert "system_fingerprint" in chunks[-1]  # on the last chunk when no usage chunk follows


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"),
    [
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
            400,
            "BadRequestError",
        ),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "NotFoundError"),
        ("/v1/completions", {"max_tokens": 2}, 400, "BadRequestError"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "BadRequestError"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "BadRequestError"),
        ("/v1/chat/completions", {"messages": []}, 400, "BadRequestError"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "BadRequestError"),
    ],
    ids=[
        "min>max",
        "unknown-model",
        "no-prompt",
        "bad-int",
        "zero-tokens",
        "no-messages",
        "too-long",
    ],
)
async def test_openai_errors(
    http: aiohttp.ClientSession,
    eng: EngineHandle,
    path: str,
    body: dict,
    status: int,
    kind: str,
    request: pytest.FixtureRequest,
) -> None:
    got, err = await post(http, eng, path, body)
    assert got == status
    assert list(err) == ["error"] and list(err["error"]) == ["message", "type", "param", "code"]
    assert err["error"]["type"] == kind and err["error"]["code"] == status
    assert err["error"]["message"]
    assert err["error"]["param"] == {"unknown-model": "model", "zero-tokens": "max_tokens"}.get(
        request.node.callspec.id
    )


async def test_invalid_json_is_400(http: aiohttp.ClientSession, eng: EngineHandle) -> None:
    async with http.post(eng.url + "/v1/completions", data=b"{nope") as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    # as vLLM 0.32 words FastAPI's error: where and why Python's json parser stopped
    assert error == {
        "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', "
        "'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
        "'ctx': {'error': 'Expecting property name enclosed in double "
        "quotes'}}",
        "type": "Bad Request",
        "param": "body.1",
        "code": 400,
    }


async def test_small_endpoints(http: aiohttp.ClientSession, eng: EngineHandle) -> None:
    models = await get_json(http, eng, "/v1/models")
    assert [m["id"] for m in models["data"]] == ["sim-model", "alias"]
    async with http.get(eng.url + "/health") as resp:
        assert resp.status == 200
    _, tok = await post(http, eng, "/tokenize", {"model": "sim-model", "prompt": "hello world"})
    assert tok["count"] == len(tok["tokens"]) == 3  # BOS + 2 words (approximation)
    _, detok = await post(http, eng, "/detokenize", {"tokens": tok["tokens"]})
    assert isinstance(detok["prompt"], str)
    _, body = await post(http, eng, "/v1/completions", {"prompt": "hello world", "max_tokens": 1})
    assert body["usage"]["prompt_tokens"] == 3
    _, body = await post(http, eng, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 1})
    assert body["usage"]["prompt_tokens"] == 4  # token ids count exactly


async def test_metrics_names(http: aiohttp.ClientSession, eng: EngineHandle) -> None:
    async with http.get(eng.url + "/metrics") as resp:
        text = await resp.text()
    for name in (
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:num_requests_kv_fetch_by_stage{",
        "process_start_time_seconds ",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="sim-model",'
        'source="local_cache_hit"}',
    ):
        assert name in text, name
    before = await metric(http, eng, "vllm:prompt_tokens_by_source_total", source="local_compute")
    await post(http, eng, "/v1/completions", {"prompt": [1] * 40, "max_tokens": 1})
    after = await metric(http, eng, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert after - before == 40


async def test_aggregated_engine_ignores_kv_params(
    http: aiohttp.ClientSession, eng: EngineHandle
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    status, resp = await post(http, eng, "/v1/completions", body, rid="agg")
    assert status == 200 and resp["kv_transfer_params"] is None
    state = await get_json(http, eng, "/sim/state")
    assert state["role"] is None and state["transfer_mode"] is None and state["leases"] == 0
    assert state["blocks_used"] == 0


async def test_api_key_guards_the_api_like_vllm(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, "--api-key", "k1", "k2") as keyed:
        body = {"prompt": "hi", "max_tokens": 1}

        async def call(method: str, path: str, auth: str | None) -> tuple[int, bytes]:
            headers = {} if auth is None else {"Authorization": auth}
            data = body if method == "POST" else None
            async with http.request(method, keyed.url + path, headers=headers, json=data) as answer:
                return answer.status, await answer.read()

        for path in ("/v1/completions", "/v1/models", "/tokenize"):
            method = "GET" if path == "/v1/models" else "POST"
            for wrong in (None, "Bearer nope", "Basic k1", "k1", "Bearer k1k1"):
                assert await call(method, path, wrong) == (401, b'{"error":"Unauthorized"}')
            for right in ("Bearer k1", "bearer k2"):
                assert (await call(method, path, right))[0] == 200, (path, right)
        for open_path in ("/health", "/version", "/metrics", "/sim/requests"):
            assert (await call("GET", open_path, None))[0] == 200, open_path
        assert (await call("OPTIONS", "/v1/completions", None))[0] != 401
        records = await get_json(http, keyed, "/sim/requests")
        # refused requests never reached the engine (GET /v1/models leaves no record)
        assert [r["path"] for r in records] == ["/v1/completions"] * 2 + ["/tokenize"] * 2


async def test_api_key_from_the_environment(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, env={"VLLM_API_KEY": "envkey"}) as keyed:
        async with http.get(keyed.url + "/v1/models") as response:
            assert response.status == 401
        headers = {"Authorization": "Bearer envkey"}
        async with http.get(keyed.url + "/v1/models", headers=headers) as response:
            assert response.status == 200


async def test_a_tokenize_request_is_recorded_as_it_arrived(
    http: aiohttp.ClientSession, eng: EngineHandle
) -> None:
    """A proxy passes /tokenize through untouched: tests read what reached the engine."""
    async with http.delete(eng.url + "/sim/requests"):
        pass
    headers = {"X-Data-Parallel-Rank": "1", "X-Request-Id": "tok-1"}
    async with http.post(eng.url + "/tokenize", json={"prompt": "hi"}, headers=headers) as r:
        assert r.status == 200
    [record] = await get_json(http, eng, "/sim/requests")
    assert record["path"] == "/tokenize" and record["outcome"] == "passed_through"
    assert record["status"] == 200 and record["body"] == {"prompt": "hi"}
    assert record["headers"]["x-data-parallel-rank"] == "1"
    assert record["x_request_id"] == "tok-1"
