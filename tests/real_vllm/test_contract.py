"""Contract: the simulator answers like real vLLM. The same requests go to vllmsim engines and to
real vLLM 0.32 CPU engines; response shapes are compared field by field (JSON keys and value
types, P's kv_transfer_params, error bodies, SSE framing and chunk shapes)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from scripts.cached_envs import tiny_model
from tests.real_vllm.clients import MODEL, body, sse_events
from tests.real_vllm.conftest import LEASE_S, EnginePool
from vllmsim.testing import PULL_D, PULL_P, PUSH_D, PUSH_P, running_engine

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

PROMPT = "The quick brown fox jumps over the lazy dog."
P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
SIM_CONNECTORS = {"push": (PUSH_P, PUSH_D), "pull": (PULL_P, PULL_D)}
# The simulator models vLLM 0.33; the engines here are 0.32. Fields vLLM added after 0.32
# (see the protocol notes) may appear only in the simulator.
NEWER_THAN_REAL = {".kv_transfer_params.remote_registration_generation"}  # 0.33, pull P


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    payload: dict[str, Any] | bytes


def cases() -> list[Case]:
    """Requests sent verbatim to one engine (P) of each kind."""
    listed = []
    leg = {"kv_transfer_params": P_PARAMS, "max_tokens": 1}
    for kind, path in (("completions", "/v1/completions"), ("chat", "/v1/chat/completions")):
        listed += [
            Case(f"{kind}", path, body(kind, PROMPT, stream=False)),
            Case(f"{kind} stream+usage", path, body(kind, PROMPT, stream=True)),
            Case(f"{kind} stream", path, {**body(kind, PROMPT, stream=False), "stream": True}),
            Case(f"{kind} prefill leg", path, {**body(kind, PROMPT, stream=False), **leg}),
            Case(f"{kind} unknown model", path, {**body(kind, PROMPT, False), "model": "nope"}),
            Case(f"{kind} bad max_tokens", path, {**body(kind, PROMPT, False), "max_tokens": -1}),
            Case(f"{kind} invalid json", path, b"{not json"),
        ]
    return listed


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def flatten(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, type) of every node; list items share the path `[]`."""
    yield path or "$", type_name(value)
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            yield from flatten(item, f"{path}[]")


def shape(value: Any) -> dict[str, set[str]]:
    result: dict[str, set[str]] = {}
    for path, kind in flatten(value):
        result.setdefault(path, set()).add(kind)
    return result


def shape_diff(where: str, sim: Any, real: Any) -> list[str]:
    sim_shape, real_shape = shape(sim), shape(real)
    diffs = []
    for path in sorted(sim_shape.keys() | real_shape.keys()):
        s, r = sim_shape.get(path), real_shape.get(path)
        if s is None:
            diffs.append(f"{where}: {path} only in vLLM ({sorted(r or ())})")
        elif r is None and path not in NEWER_THAN_REAL:
            diffs.append(f"{where}: {path} only in vllmsim ({sorted(s)})")
        elif r is not None and s != r and "null" not in s | r:
            # null vs a value depends on the run, not on the shape
            diffs.append(f"{where}: {path} vllmsim {sorted(s)} != vLLM {sorted(r)}")
    return diffs


@dataclass
class Reply:
    status: int
    content_type: str
    raw: bytes


async def send(session: aiohttp.ClientSession, url: str, case: Case) -> Reply:
    kwargs: dict[str, Any] = {"headers": {"X-Request-Id": str(uuid.uuid4())}}
    if isinstance(case.payload, bytes):
        kwargs["data"] = case.payload
        kwargs["headers"]["Content-Type"] = "application/json"
    else:
        kwargs["json"] = case.payload
    async with session.post(url + case.path, **kwargs) as response:
        return Reply(response.status, response.headers.get("Content-Type", ""),
                     await response.read())


def sse_roles(raw: bytes) -> dict[str, Any]:
    """Stream chunks by role: first, last with a finish_reason, the usage chunk."""
    chunks = [orjson.loads(e) for e in sse_events(raw) if e != b"[DONE]"]
    roles: dict[str, Any] = {"first": chunks[0]}
    finals = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    if finals:
        roles["final"] = finals[-1]
    usage = [c for c in chunks if not c["choices"]]
    if usage:
        roles["usage"] = usage[-1]
    if len(chunks) > 2:
        roles["middle"] = chunks[1] if "final" not in roles or chunks[1] is not finals[-1] else {}
    return roles


def framing_problems(raw: bytes) -> list[str]:
    frames = raw.split(b"\n\n")
    problems = []
    if frames[-1] != b"":
        problems.append("does not end with a blank line")
    if frames[-2:-1] != [b"data: [DONE]"]:
        problems.append("last event is not [DONE]")
    problems += [f"frame without 'data: ': {f[:40]!r}" for f in frames[:-1]
                 if not f.startswith(b"data: ")]
    return problems


def compare(case: Case, sim: Reply, real: Reply) -> list[str]:
    where = case.name
    if sim.status != real.status:
        return [f"{where}: status vllmsim {sim.status} != vLLM {real.status} "
                f"(vLLM said {real.raw[:200]!r})"]
    sim_type, real_type = (r.content_type.split(";")[0] for r in (sim, real))
    diffs = [] if sim_type == real_type else [f"{where}: content-type {sim_type} != {real_type}"]
    if real_type == "text/event-stream":
        diffs += [f"{where} (vllmsim SSE): {p}" for p in framing_problems(sim.raw)]
        diffs += [f"{where} (vLLM SSE): {p}" for p in framing_problems(real.raw)]
        sim_roles, real_roles = sse_roles(sim.raw), sse_roles(real.raw)
        for role in sorted(sim_roles.keys() | real_roles.keys()):
            diffs += shape_diff(f"{where} [{role} chunk]", sim_roles.get(role),
                                real_roles.get(role))
        return diffs
    sim_json, real_json = orjson.loads(sim.raw), orjson.loads(real.raw)
    diffs += shape_diff(where, sim_json, real_json)
    if real.status >= 400 and sim_json["error"]["type"] != real_json["error"]["type"]:
        diffs.append(f"{where}: error type {sim_json['error']['type']} != "
                     f"{real_json['error']['type']}")
    return diffs


async def decode_leg(session: aiohttp.ClientSession, p_url: str, d_url: str) -> Reply:
    """A whole serial P→D exchange (same X-Request-Id on both legs); D's reply."""
    rid = str(uuid.uuid4())
    prefill = {**body("completions", PROMPT, False, max_tokens=1), "kv_transfer_params": P_PARAMS}
    async with session.post(p_url + "/v1/completions", json=prefill,
                            headers={"X-Request-Id": rid}) as response:
        params = (await response.json())["kv_transfer_params"]
    decode = {**body("completions", PROMPT, False), "kv_transfer_params": params}
    async with session.post(d_url + "/v1/completions", json=decode,
                            headers={"X-Request-Id": rid}) as response:
        return Reply(response.status, response.headers.get("Content-Type", ""),
                     await response.read())


async def contract_diffs(pool: EnginePool, session: aiohttp.ClientSession, mode: str) -> list[str]:
    real_p, real_d = await pool.get(mode)
    flags = ("--served-model-name", MODEL, "--tokenizer", str(tiny_model()),
             "--max-model-len", "2048")
    async with AsyncExitStack() as stack:
        sim_p, sim_d = [await stack.enter_async_context(
            running_engine("--kv-transfer-config", c, *flags)) for c in SIM_CONNECTORS[mode]]
        diffs = []
        for case in cases():
            diffs += compare(case, await send(session, sim_p.url, case),
                             await send(session, real_p.url, case))
        diffs += compare(Case("decode leg", "/v1/completions", b""),
                         await decode_leg(session, sim_p.url, sim_d.url),
                         await decode_leg(session, real_p.url, real_d.url))
    # The prefill-leg cases left blocks on P that no decode will take: let their (short) lease
    # run out here, so that the expiry does not show up in the next test's window.
    await asyncio.sleep(LEASE_S + 2)
    return diffs


@pytest.mark.pair("push")
async def test_simulator_matches_vllm_push(pool: EnginePool,
                                           session: aiohttp.ClientSession) -> None:
    diffs = await contract_diffs(pool, session, "push")
    assert not diffs, "\n".join(diffs)


@pytest.mark.pair("pull")
async def test_simulator_matches_vllm_pull(pool: EnginePool,
                                           session: aiohttp.ClientSession) -> None:
    diffs = await contract_diffs(pool, session, "pull")
    assert not diffs, "\n".join(diffs)
