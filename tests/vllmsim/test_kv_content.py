"""The KV carries content: D's answer follows the KV it received, and its KV label follows
where its prompt blocks came from.

A correct pull or push gives exactly the answer of a plain engine (no connector); wrong block
ids, a truncated transfer or another request's KV give a different answer; a stale engine id
fails the request, or recomputes it locally under kv_load_failure_policy=recompute.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.vllmsim.vsim_helpers import PROMPT, get_json, post
from vllmsim.launcher import (
    FAST,
    PULL_D,
    PULL_P,
    PUSH_D,
    PUSH_P,
    EngineHandle,
    running_engine_sync,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Same token count as PROMPT (one word swapped), so its KV fills D's prompt blocks exactly.
OTHER_PROMPT = PROMPT.replace("lazy", "sleepy", 1)
RECOMPUTE_PULL_D = json.dumps({**json.loads(PULL_D), "kv_load_failure_policy": "recompute"})
RECOMPUTE_PUSH_D = json.dumps({**json.loads(PUSH_D), "kv_load_failure_policy": "recompute"})

Tamper = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Engines:
    plain: EngineHandle  # no connector: the aggregated reference
    pull_p: EngineHandle
    pull_d: EngineHandle
    push_p: EngineHandle
    push_d: EngineHandle
    pull_d_recompute: EngineHandle
    push_d_recompute: EngineHandle

    def pair(self, mode: str) -> tuple[EngineHandle, EngineHandle]:
        return (self.pull_p, self.pull_d) if mode == "pull" else (self.push_p, self.push_d)


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    """The tests send the same prompts again and again: without prefix caching every transfer
    covers the whole prompt (test_prefix_cache.py covers a D that holds part of it)."""
    configs = (None, PULL_P, PULL_D, PUSH_P, PUSH_D, RECOMPUTE_PULL_D, RECOMPUTE_PUSH_D)
    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(
                running_engine_sync(
                    *FAST,
                    "--no-enable-prefix-caching",
                    *(("--kv-transfer-config", c) if c else ()),
                )
            )
            for c in configs
        ]
        yield Engines(*handles)


@pytest.fixture
async def eng(engines: Engines, http: aiohttp.ClientSession) -> Engines:
    """The module's engines, with no fault left over from an earlier test."""
    for handle in (engines.pull_p, engines.push_p):
        async with http.delete(handle.url + "/sim/faults") as resp:
            assert resp.status == 200
    return engines


def body(path: str, stream: bool, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    text = (
        {"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt}
    )
    out: dict[str, Any] = {"model": "sim-model", **text, "max_tokens": 8, "stream": stream, **extra}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def answer(
    http: aiohttp.ClientSession,
    eng: EngineHandle,
    path: str,
    request: dict[str, Any],
    rid: str | None = None,
) -> str:
    """The generated text, streamed or not."""
    headers = {"X-Request-Id": rid} if rid else {}
    async with http.post(eng.url + path, json=request, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    if not request.get("stream"):
        choice = json.loads(raw)["choices"][0]
        return str(choice["message"]["content"] if path == CHAT else choice["text"])
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert "error" not in events[-1], events[-1]
    key = (lambda c: c["delta"].get("content", "")) if path == CHAT else (lambda c: c["text"])
    return "".join(key(c) for e in events for c in e["choices"])


async def prefill(
    http: aiohttp.ClientSession, p: EngineHandle, path: str, rid: str, prompt: str = PROMPT
) -> dict[str, Any]:
    request = body(path, False, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    status, resp = await post(http, p, path, request, rid=rid)
    assert status == 200, resp
    params: dict[str, Any] = resp["kv_transfer_params"]
    return params


async def disaggregated(
    http: aiohttp.ClientSession,
    p: EngineHandle,
    d: EngineHandle,
    path: str,
    rid: str,
    stream: bool = False,
    tamper: Tamper = lambda params: params,
) -> str:
    """Serial P/D: P's params, through `tamper`, go to D; D's answer."""
    params = tamper(await prefill(http, p, path, rid))
    return await answer(http, d, path, body(path, stream, kv_transfer_params=params), rid)


async def record(http: aiohttp.ClientSession, eng: EngineHandle, rid: str) -> dict[str, Any]:
    [rec] = [r for r in await get_json(http, eng, "/sim/requests") if r["x_request_id"] == rid]
    return rec


async def set_faults(http: aiohttp.ClientSession, eng: EngineHandle, **faults: int) -> None:
    async with http.post(eng.url + "/sim/faults", json=faults) as resp:
        assert resp.status == 200


def prompt_blocks(rec: dict[str, Any]) -> int:
    return sum(rec["kv_evidence"]["blocks"].values())


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_correct_transfer_equals_aggregated(
    http: aiohttp.ClientSession, eng: Engines, mode: str, path: str, stream: bool
) -> None:
    p, d = eng.pair(mode)
    rid = f"ok-{mode}-{path[4:8]}-{stream}"
    expected = await answer(http, eng.plain, path, body(path, stream))
    assert await disaggregated(http, p, d, path, rid, stream) == expected
    rec = await record(http, d, rid)
    label = "pull" if mode == "pull" else "push-serial"
    assert rec["kv"] == label
    assert rec["kv_evidence"] == {
        "blocks": {label: prompt_blocks(rec)},
        "engine_ids": [p.engine_id],
    }


async def test_aggregated_evidence_is_local(http: aiohttp.ClientSession, eng: Engines) -> None:
    await answer(http, eng.plain, COMPLETIONS, body(COMPLETIONS, False), rid="agg")
    rec = await record(http, eng.plain, "agg")
    assert rec["kv"] == "local"
    assert rec["kv_evidence"]["engine_ids"] == [eng.plain.engine_id]
    assert list(rec["kv_evidence"]["blocks"]) == ["local"]


def shifted(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "remote_block_ids": [[b + 1 for b in params["remote_block_ids"][0]]]}


def reversed_ids(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "remote_block_ids": [params["remote_block_ids"][0][::-1]]}


def cut_short(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "remote_block_ids": [params["remote_block_ids"][0][:2]]}


@pytest.mark.parametrize("tamper", [shifted, reversed_ids], ids=["shifted", "reversed"])
async def test_pull_from_wrong_block_ids_differs(
    http: aiohttp.ClientSession, eng: Engines, tamper: Tamper
) -> None:
    expected = await answer(http, eng.plain, COMPLETIONS, body(COMPLETIONS, False))
    rid = f"wrong-ids-{tamper.__name__}"
    got = await disaggregated(http, eng.pull_p, eng.pull_d, COMPLETIONS, rid, tamper=tamper)
    assert got != expected
    # D's blocks were written by the READ: the label says so, the answer shows it was wrong.
    assert (await record(http, eng.pull_d, rid))["kv"] == "pull"


async def test_pull_of_too_few_blocks_differs(http: aiohttp.ClientSession, eng: Engines) -> None:
    expected = await answer(http, eng.plain, COMPLETIONS, body(COMPLETIONS, False))
    got = await disaggregated(http, eng.pull_p, eng.pull_d, COMPLETIONS, "short", tamper=cut_short)
    assert got != expected
    rec = await record(http, eng.pull_d, "short")
    assert rec["kv"] == "partial" and rec["kv_evidence"]["blocks"]["pull"] == 2
    assert rec["kv_evidence"]["blocks"]["empty"] == prompt_blocks(rec) - 2


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    "fault", [{"kv_block_offset": 1}, {"kv_truncate_blocks": 1}], ids=["wrong-blocks", "truncated"]
)
async def test_broken_transfer_differs(
    http: aiohttp.ClientSession, eng: Engines, mode: str, fault: dict[str, int]
) -> None:
    p, d = eng.pair(mode)
    expected = await answer(http, eng.plain, COMPLETIONS, body(COMPLETIONS, True))
    await set_faults(http, p, **fault)
    rid = f"broken-{mode}-{next(iter(fault))}"
    assert await disaggregated(http, p, d, COMPLETIONS, rid, stream=True) != expected
    rec = await record(http, d, rid)
    if "kv_truncate_blocks" in fault:
        assert rec["kv"] == "partial" and rec["kv_evidence"]["blocks"]["empty"] == 1


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_kv_of_another_request_gives_its_answer(
    http: aiohttp.ClientSession, eng: Engines, mode: str
) -> None:
    """D is handed P's params for another prompt of the same length (a stale or mispaired
    transfer): D answers what that prompt's KV says, not its own prompt."""
    p, d = eng.pair(mode)
    own = await answer(http, eng.plain, COMPLETIONS, body(COMPLETIONS, False))
    other = await answer(http, eng.plain, COMPLETIONS, body(COMPLETIONS, False, OTHER_PROMPT))
    assert own != other
    rid = f"mixed-{mode}"
    params = await prefill(http, p, COMPLETIONS, rid, prompt=OTHER_PROMPT)
    got = await answer(
        http, d, COMPLETIONS, body(COMPLETIONS, False, kv_transfer_params=params), rid
    )
    assert got == other


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_stale_engine_id_fails_or_recomputes(
    http: aiohttp.ClientSession, eng: Engines, mode: str
) -> None:
    p, d = eng.pair(mode)
    recompute_d = eng.pull_d_recompute if mode == "pull" else eng.push_d_recompute
    expected = await answer(http, eng.plain, COMPLETIONS, body(COMPLETIONS, False))
    params = {
        **await prefill(http, p, COMPLETIONS, f"stale-{mode}"),
        "remote_engine_id": "engine-before-restart",
    }
    request = body(COMPLETIONS, False, kv_transfer_params=params)
    # kv_load_failure_policy=fail (vLLM's default): the failed recv is a 500.
    status, resp = await post(http, d, COMPLETIONS, request, rid=f"stale-{mode}")
    assert status == 500 and resp["error"]["message"] == "Internal server error"
    # recompute: D prefills itself; the answer is right and the evidence says where it came from.
    assert await answer(http, recompute_d, COMPLETIONS, request, f"stale-{mode}") == expected
    rec = await record(http, recompute_d, f"stale-{mode}")
    assert rec["kv"] == "recompute"
    assert rec["kv_evidence"] == {
        "blocks": {"local": prompt_blocks(rec)},
        "engine_ids": [recompute_d.engine_id],
    }


async def test_blocks_are_freed_with_their_content(
    http: aiohttp.ClientSession, eng: Engines
) -> None:
    """Once a transfer is done, P's blocks are free and forget what they held: a READ that
    names them again gets zeros, and an answer unlike the aggregated one."""
    expected = await answer(http, eng.plain, COMPLETIONS, body(COMPLETIONS, False))
    params = await prefill(http, eng.pull_p, COMPLETIONS, "reuse-1")
    request = body(COMPLETIONS, False, kv_transfer_params=params)
    assert await answer(http, eng.pull_d, COMPLETIONS, request, "reuse-1") == expected
    # A READ of reuse-1's block ids (free now) under reuse-2's live lease: stale ids.
    fresh = await prefill(http, eng.pull_p, COMPLETIONS, "reuse-2", prompt="x")
    stale = {**fresh, "remote_block_ids": params["remote_block_ids"]}
    got = await answer(
        http, eng.pull_d, COMPLETIONS, body(COMPLETIONS, False, kv_transfer_params=stale), "reuse-2"
    )
    assert got != expected
