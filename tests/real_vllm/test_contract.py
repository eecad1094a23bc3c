"""Contract: the simulator answers like real vLLM.

The same requests, with the same X-Request-Id, go to vllmsim engines and to real vLLM 0.32 CPU
engines: P alone (answers, streams, the prefill leg, client errors) and whole P→D exchanges in
which D is handed good, stale, malformed or incomplete kv_transfer_params, in push and pull mode.
Replies are compared by value: status, content type, every JSON field, every SSE event in order.
A value that cannot match between two engines is compared by pattern instead (VARIABLE, each with
its reason); where vllmsim knowingly behaves otherwise, the case says why (DIFFERENCES) and
asserts what each side does.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from scripts.cached_envs import tiny_model
from tests.real_vllm.clients import MODEL, PATHS, body, sse_events
from tests.support.real_vllm import LEASE_S, EnginePool
from vllmsim.launcher import PULL_D, PULL_P, PUSH_D, PUSH_P, running_engine

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

PROMPT = "The quick brown fox jumps over the lazy dog."
P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
SIM_CONNECTORS = {"push": (PUSH_P, PUSH_D), "pull": (PULL_P, PULL_D)}
REQUEST_TIMEOUT_S = 30
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."

Check = Callable[[Any], bool]


def _matches(pattern: str) -> Check:
    return lambda value: isinstance(value, str) and re.fullmatch(pattern, value) is not None


def _block_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], list)
        and len(value[0]) > 0
        and all(isinstance(b, int) for b in value[0])
    )


_HEX8, _UUID = "[0-9a-f]{8}", "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
# Fields whose value differs between any two engines, by key: compared by this check instead.
VARIABLE: dict[str, tuple[Check, str]] = {
    "created": (lambda v: isinstance(v, int), "the second the answer was made"),
    "system_fingerprint": (
        _matches(rf"vllm-0\.3[23]\.0-{_HEX8}"),
        "vLLM's version (vllmsim models 0.33) and a random suffix per process",
    ),
    "text": (
        lambda v: isinstance(v, str),
        "generated text: random weights in vLLM, a hash of the prompt in vllmsim",
    ),
    "content": (lambda v: isinstance(v, str), "generated text, as `text`"),
    "remote_engine_id": (_matches(_UUID), "a fresh uuid4 per engine start"),
    "remote_request_id": (
        _matches(rf"(chatcmpl-{_UUID}|cmpl-{_UUID}-0)-{_HEX8}"),
        "P's internal id: the external id plus a random suffix",
    ),
    "remote_port": (lambda v: isinstance(v, int), "each engine's ephemeral side-channel port"),
    "remote_block_ids": (_block_ids, "where each engine's allocator put the prompt"),
}
# Chat prompts: vLLM renders them with the model's chat template, vllmsim with a fixed stand-in
# (rendering a model's Jinja template needs a template engine vllmsim does not ship), so in chat
# answers the counts that include the prompt differ; completions counts are compared exactly.
CHAT_PROMPT_COUNTS: dict[str, tuple[Check, str]] = {
    key: (lambda v: isinstance(v, int), "chat template")
    for key in ("prompt_tokens", "total_tokens", "remote_num_tokens")
}
# vllmsim models vLLM 0.33; fields added after 0.32 (see the protocol notes) are only in it.
NEWER_THAN_REAL = {".kv_transfer_params.remote_registration_generation"}  # 0.33, pull P
# Cases where vllmsim does not do what vLLM 0.32 does, and why; each case asserts both sides.
DIFFERENCES = {
    "push missing key": (
        "vLLM's EngineCore dies on the KeyError and the API server exits; vllmsim gives the same "
        "answer but stays up (a simulator that dies would take every later test with it). "
        "pd-extproc never sends D params without P's identity."
    ),
    "pull missing key": (
        "vllmsim follows vLLM 0.33, which logs 'Got invalid KVTransferParams' and prefills "
        "locally; 0.32 parks the request for a transfer it never starts and its EngineCore then "
        "dies (here at once on the missing block ids). pd-extproc forwards P's params verbatim."
    ),
}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    payload: dict[str, Any] | bytes


def prefill_cases() -> list[Case]:
    """Requests sent verbatim to one engine (P) of each kind."""
    listed = []
    leg = {"kv_transfer_params": P_PARAMS, "max_tokens": 1}
    for kind, path in PATHS.items():
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


Params = Callable[[dict[str, Any]], Any]


def _without(key: str) -> Params:
    return lambda params: {k: v for k, v in params.items() if k != key}


def _stale(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "remote_engine_id": str(uuid.uuid4())}  # P restarted since


@dataclass(frozen=True)
class DecodeCase:
    """A serial P→D exchange; `params` turns P's kv_transfer_params into what D is given."""

    name: str
    kind: str
    stream: bool
    params: Params


def decode_cases() -> list[DecodeCase]:
    listed = [
        DecodeCase(f"decode {kind}{' stream' if stream else ''}", kind, stream, dict)
        for kind in PATHS
        for stream in (False, True)
    ]
    listed += [
        DecodeCase(f"stale engine id{' stream' if stream else ''}", "completions", stream, _stale)
        for stream in (False, True)
    ]
    listed.append(DecodeCase("params not an object", "completions", False, lambda _: "nope"))
    return listed


# The last case of each mode: real vLLM's D dies on it (see DIFFERENCES).
MISSING_KEY = {
    "push": DecodeCase("push missing key", "completions", True, _without("remote_request_id")),
    "pull": DecodeCase("pull missing key", "completions", False, _without("remote_block_ids")),
}


@dataclass
class Reply:
    status: int
    content_type: str
    raw: bytes


async def send(
    session: aiohttp.ClientSession, url: str, path: str, payload: dict[str, Any] | bytes, rid: str
) -> Reply:
    kwargs: dict[str, Any] = {
        "headers": {"X-Request-Id": rid},
        "timeout": aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    }
    if isinstance(payload, bytes):
        kwargs["data"] = payload
        kwargs["headers"]["Content-Type"] = "application/json"
    else:
        kwargs["json"] = payload
    async with session.post(url + path, **kwargs) as response:
        return Reply(
            response.status, response.headers.get("Content-Type", ""), await response.read()
        )


async def exchange(
    session: aiohttp.ClientSession, p_url: str, d_url: str, case: DecodeCase, rid: str
) -> Reply:
    """P's leg, then D's with the params `case` makes of P's answer; D's reply."""
    path = PATHS[case.kind]
    prefill = {**body(case.kind, PROMPT, False, max_tokens=1), "kv_transfer_params": P_PARAMS}
    answer = await send(session, p_url, path, prefill, rid)
    assert answer.status == 200, answer.raw
    params = case.params(orjson.loads(answer.raw)["kv_transfer_params"])
    decode = {**body(case.kind, PROMPT, case.stream), "kv_transfer_params": params}
    return await send(session, d_url, path, decode, rid)


def normalise(
    value: Any, variable: dict[str, tuple[Check, str]], path: str = ""
) -> tuple[Any, list[str]]:
    """`value` with every `variable` field replaced by its key, and the fields that fail their
    check; NEWER_THAN_REAL fields are left out."""
    problems: list[str] = []
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            where = f"{path}.{key}"
            if where in NEWER_THAN_REAL:
                continue
            if key in variable and item is not None:
                check, _ = variable[key]
                out[key] = f"<{key}>"
                if not check(item):
                    problems.append(f"{where} = {item!r} is not of the expected form")
                continue
            out[key], found = normalise(item, variable, where)
            problems += found
        return out, problems
    if isinstance(value, list):
        items = [normalise(item, variable, f"{path}[]") for item in value]
        return [item for item, _ in items], [p for _, found in items for p in found]
    return value, problems


def value_diff(where: str, sim: Any, real: Any, path: str = "") -> list[str]:
    if isinstance(sim, dict) and isinstance(real, dict):
        diffs = []
        if list(sim) != list(real) and set(sim) == set(real):
            diffs.append(f"{where}: {path or '$'} key order {list(sim)} != {list(real)}")
        for key in sorted(sim.keys() | real.keys()):
            if key not in real:
                diffs.append(f"{where}: {path}.{key} only in vllmsim ({sim[key]!r})")
            elif key not in sim:
                diffs.append(f"{where}: {path}.{key} only in vLLM ({real[key]!r})")
            else:
                diffs += value_diff(where, sim[key], real[key], f"{path}.{key}")
        return diffs
    if isinstance(sim, list) and isinstance(real, list) and len(sim) == len(real):
        return [
            d
            for i, (s, r) in enumerate(zip(sim, real, strict=True))
            for d in value_diff(where, s, r, f"{path}[{i}]")
        ]
    if sim != real or type(sim) is not type(real):
        return [f"{where}: {path or '$'} vllmsim {sim!r} != vLLM {real!r}"]
    return []


def events(raw: bytes) -> list[Any]:
    return [e.decode() if e == b"[DONE]" else orjson.loads(e) for e in sse_events(raw)]


def framing_problems(raw: bytes) -> list[str]:
    frames = raw.split(b"\n\n")
    problems = []
    if frames[-1] != b"":
        problems.append("does not end with a blank line")
    if frames[-2:-1] != [b"data: [DONE]"]:
        problems.append("last event is not [DONE]")
    problems += [
        f"frame without 'data: ': {f[:40]!r}" for f in frames[:-1] if not f.startswith(b"data: ")
    ]
    return problems


def compare(where: str, sim: Reply, real: Reply, chat: bool = False) -> list[str]:
    """Every difference between the two replies that VARIABLE does not explain."""
    if sim.status != real.status:
        return [
            f"{where}: status vllmsim {sim.status} != vLLM {real.status} "
            f"(vllmsim {sim.raw[:200]!r}, vLLM {real.raw[:200]!r})"
        ]
    sim_type, real_type = (r.content_type.split(";")[0] for r in (sim, real))
    diffs = [] if sim_type == real_type else [f"{where}: content-type {sim_type} != {real_type}"]
    if real_type == "text/event-stream":
        diffs += [f"{where} (vllmsim SSE): {p}" for p in framing_problems(sim.raw)]
        diffs += [f"{where} (vLLM SSE): {p}" for p in framing_problems(real.raw)]
        sim_value, real_value = events(sim.raw), events(real.raw)
        if len(sim_value) != len(real_value):
            diffs.append(f"{where}: {len(sim_value)} events in vllmsim, {len(real_value)} in vLLM")
        # An error event is the one vLLM writes with spaces: compare it byte for byte.
        sim_errors, real_errors = (
            [e for e in sse_events(r.raw) if e.startswith(b'{"error"')] for r in (sim, real)
        )
        if sim_errors != real_errors:
            diffs.append(f"{where}: error events vllmsim {sim_errors} != vLLM {real_errors}")
    else:
        sim_value, real_value = orjson.loads(sim.raw), orjson.loads(real.raw)
    variable = {**VARIABLE, **CHAT_PROMPT_COUNTS} if chat else VARIABLE
    sim_norm, sim_problems = normalise(sim_value, variable)
    real_norm, real_problems = normalise(real_value, variable)
    diffs += [f"{where} (vllmsim): {p}" for p in sim_problems]
    diffs += [f"{where} (vLLM): {p}" for p in real_problems]
    return diffs + value_diff(where, sim_norm, real_norm)


async def healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def wait_dead(session: aiohttp.ClientSession, url: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while await healthy(session, url):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)
    return True


async def missing_key_diffs(
    session: aiohttp.ClientSession, mode: str, sim_urls: tuple[str, str], real_urls: tuple[str, str]
) -> list[str]:
    """The case that kills real vLLM's D: both answers checked, then who is still up."""
    case = MISSING_KEY[mode]
    rid = str(uuid.uuid4())
    sim = await exchange(session, *sim_urls, case, rid)
    real = await exchange(session, *real_urls, case, rid)
    diffs = []
    if mode == "push":  # the same answer; only the aftermath differs
        diffs += compare(case.name, sim, real)
    else:
        if sim.status != 200:
            diffs.append(f"{case.name}: vllmsim did not recompute: {sim.status} {sim.raw[:200]!r}")
        error = orjson.loads(real.raw).get("error", {}) if real.status == 500 else {}
        if error.get("message") != ENGINE_DEAD:
            diffs.append(f"{case.name}: vLLM answered {real.status} {real.raw[:200]!r}")
    if not await wait_dead(session, real_urls[1]):
        diffs.append(f"{case.name}: vLLM's D survived (DIFFERENCES says it dies)")
    if not await healthy(session, sim_urls[1]):
        diffs.append(f"{case.name}: vllmsim's D died")
    return diffs


async def contract_diffs(pool: EnginePool, session: aiohttp.ClientSession, mode: str) -> list[str]:
    real_p, real_d = await pool.get(f"{mode}_contract")
    flags = (
        "--served-model-name",
        MODEL,
        "--tokenizer",
        str(tiny_model()),
        "--max-model-len",
        "2048",
    )
    async with AsyncExitStack() as stack:
        sim_p, sim_d = [
            await stack.enter_async_context(running_engine("--kv-transfer-config", c, *flags))
            for c in SIM_CONNECTORS[mode]
        ]
        diffs = []
        for case in prefill_cases():
            rid = str(uuid.uuid4())
            sim = await send(session, sim_p.url, case.path, case.payload, rid)
            real = await send(session, real_p.url, case.path, case.payload, rid)
            diffs += compare(case.name, sim, real, case.path == PATHS["chat"])
        for decode_case in decode_cases():
            rid = str(uuid.uuid4())
            sim = await exchange(session, sim_p.url, sim_d.url, decode_case, rid)
            real = await exchange(session, real_p.url, real_d.url, decode_case, rid)
            diffs += compare(decode_case.name, sim, real, decode_case.kind == "chat")
        try:
            diffs += await missing_key_diffs(
                session, mode, (sim_p.url, sim_d.url), (real_p.url, real_d.url)
            )
        finally:
            await pool.drop("D")  # dead or not, the next test gets a fresh D
    # The prefill legs left blocks on P that no decode took: let their (short) lease run out
    # here, so that the expiry does not show up in the next test's window.
    await asyncio.sleep(LEASE_S + 2)
    return diffs


@pytest.mark.pair("push_contract")
async def test_simulator_matches_vllm_push(
    pool: EnginePool, session: aiohttp.ClientSession
) -> None:
    diffs = await contract_diffs(pool, session, "push")
    assert not diffs, "\n".join(diffs)


@pytest.mark.pair("pull_contract")
async def test_simulator_matches_vllm_pull(
    pool: EnginePool, session: aiohttp.ClientSession
) -> None:
    diffs = await contract_diffs(pool, session, "pull")
    assert not diffs, "\n".join(diffs)
