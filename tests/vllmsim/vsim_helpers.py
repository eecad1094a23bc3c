"""Small request/polling helpers and P/D bodies shared by the vllmsim tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from vllmsim.launcher import EngineHandle

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


async def post(
    http: aiohttp.ClientSession,
    eng: EngineHandle,
    path: str,
    body: dict[str, Any],
    rid: str | None = None,
) -> tuple[int, Any]:
    headers = {"X-Request-Id": rid} if rid else {}
    async with http.post(eng.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def get_json(http: aiohttp.ClientSession, eng: EngineHandle, path: str) -> Any:
    async with http.get(eng.url + path) as resp:
        assert resp.status == 200
        return await resp.json()


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 10.0) -> None:
    """Poll `check` until true; fail the test after `within` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def metric(http: aiohttp.ClientSession, eng: EngineHandle, name: str, **labels: str) -> float:
    async with http.get(eng.url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {labels} not found")


def p_body(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
        **extra,
    }


IDENTITY_KEYS = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size", "dcp_size")


def identity(p: EngineHandle, placeholder: str) -> dict[str, Any]:
    """What a parallel router gives D: P's identity plus a placeholder request id."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.side_channel_port,
        "tp_size": 1,
        "pp_size": 1,
        "dcp_size": 1,
        "remote_request_id": placeholder,
    }


def d_body(
    params: dict[str, Any] | str | None, stream: bool = False, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "prompt": PROMPT,
        "max_tokens": 8,
        "stream": stream,
        "kv_transfer_params": params,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def record(http: aiohttp.ClientSession, eng: EngineHandle, rid: str) -> dict[str, Any]:
    recs = [r for r in await get_json(http, eng, "/sim/requests") if r["x_request_id"] == rid]
    assert len(recs) == 1
    return recs[0]
