"""kv_cache without a tokenizer or KV events: the plan routes a prompt by what this sidecar sent
each engine of it (its raw bytes), weighed against the engines' queues, through the real
scheduler and pickers."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import orjson
import pytest

from extproc.policies import PrefixPicker
from extproc.request.approx_cache import approximate
from extproc.request.parse import Api, ClientRequest, parse_request
from extproc.request.plan import (
    DecodeOnlyPlan,
    SerialPlan,
    land_on_decode,
    pick_request,
    plan_request,
)
from extproc.scheduling.pool import EndpointState
from extproc.wiring import Runtime
from tests.support.routing import fixed_routing_config

P1, P2 = "127.0.0.1:8101", "127.0.0.1:8102"
D1, D2 = "127.0.0.1:8201", "127.0.0.1:8202"
SHARED = " ".join(f"word{i}" for i in range(30))  # 1 full block of 128 bytes, and some


def runtime(prefill: dict[str, Any] | None = None, **extra: Any) -> Runtime:
    pools = {
        "prefill": {"endpoints": [P1, P2], "policy": "kv_cache", **(prefill or {})},
        "decode": {"endpoints": [D1, D2], "policy": "kv_cache"},
    }
    return Runtime(fixed_routing_config(pools | extra), "unix:/x")


def completion(prompt: str, **fields: object) -> ClientRequest:
    raw = orjson.dumps({"model": "m", "prompt": prompt, **fields})
    return parse_request(Api.COMPLETIONS, raw, 1 << 20)


def hashed_to(request: ClientRequest, engines: list[str]) -> str:
    """Where prompt-start hashing (the fallback, and kv_cache without this) sends it."""
    states = [EndpointState(e) for e in engines]
    return PrefixPicker().pick(states, pick_request(request, None)).address


def two_hashed_apart(prefix: str, engines: list[str]) -> tuple[ClientRequest, ClientRequest]:
    """Two prompts that share `prefix` but that prompt-start hashing sends apart."""
    first = completion(f"{prefix} tail0")
    for n in range(1, 200):
        second = completion(f"{prefix} tail{n}")
        if hashed_to(second, engines) != hashed_to(first, engines):
            return first, second
    raise AssertionError("no two prompts hashed apart")


def plan(rt: Runtime, request: ClientRequest, inflight: ExitStack) -> Any:
    return plan_request(request, {}, rt.config, rt.scheduler, rt.identities, inflight)


def test_a_repeated_prefix_goes_where_it_went_before() -> None:
    rt = runtime()
    first, second = two_hashed_apart(SHARED, [P1, P2])
    with ExitStack() as inflight:
        went = plan(rt, first, inflight)
    with ExitStack() as inflight:
        again = plan(rt, second, inflight)
    assert isinstance(went, SerialPlan) and isinstance(again, SerialPlan)
    assert went.prefill == hashed_to(first, [P1, P2])  # new: hashed, as without the estimate
    assert again.prefill == went.prefill != hashed_to(second, [P1, P2])
    assert again.decodes[0] == went.decodes[0]


def test_a_repeated_prefix_spills_once_its_queue_outweighs_what_the_cache_saves() -> None:
    """A prompt of 4 KiB (32 blocks: ~1024 tokens at 4 bytes a token) was sent to one P:
    requests sharing it keep going there while they are in flight, each adding its uncached
    tokens (2: its question) and the cost of a request (64), until that work passes what the
    cache is worth there (kv_cached_token_weight 2 × 1024): the 33rd goes to the idle P.
    Prompt-start hashing would spill the 4th (its load bound)."""
    rt = runtime()
    long_prefix = "x" * (4096 - len('"prompt":"'))  # the member's first 32 blocks
    with ExitStack() as inflight:
        holder = plan(rt, completion(f"{long_prefix} first"), inflight).prefill
    picks = []
    with ExitStack() as inflight:
        for n in range(40):
            picks.append(plan(rt, completion(f"{long_prefix} q{n:02}"), inflight).prefill)
    spill = picks.index(next(p for p in picks if p != holder))
    assert spill == 32, picks  # 2 × 1024 − 32 × 66 < 0 ≤ 2 × 1024 − 31 × 66


def test_the_decision_counts_only_what_has_reached_d() -> None:
    """Threshold mode (decode-only up to 64 uncached tokens): the next turn of a long prompt
    goes decode-only to the D that was sent it once D has answered it (its KV is there); while
    its P may still be computing it, D would compute it all: through P. Salted, it was sent
    nowhere: through P."""
    rt = runtime(decision={"mode": "threshold", "max_prompt_tokens": 64})
    prompt = "y" * 2000
    with ExitStack() as inflight:
        went = plan(rt, completion(prompt), inflight)
    assert isinstance(went, SerialPlan)  # ~500 tokens, nothing cached: P/D
    with ExitStack() as inflight:
        early = plan(rt, completion(prompt + " more"), inflight)
    assert isinstance(early, SerialPlan) and early.decodes[0] == went.decodes[0]
    land_on_decode(went, rt.kv)  # D answered it
    with ExitStack() as inflight:
        again = plan(rt, completion(prompt + " more"), inflight)
    assert isinstance(again, DecodeOnlyPlan) and again.decodes[0] == went.decodes[0]
    with ExitStack() as inflight:
        salted = plan(rt, completion(prompt + " more", cache_salt="s"), inflight)
    assert isinstance(salted, SerialPlan)


def test_with_token_ids_too_the_decision_counts_only_what_has_reached_d() -> None:
    """The same with the prompt tokenized (engines that publish no events: what was routed
    where, by token blocks)."""
    rt = runtime(decision={"mode": "threshold", "max_prompt_tokens": 64})
    ids = list(range(600))

    def planned(tokens: list[int]) -> Any:
        with ExitStack() as inflight:
            return plan_request(
                completion("x"), {}, rt.config, rt.scheduler, rt.identities, inflight, tokens=tokens
            )

    went = planned(ids)
    assert isinstance(went, SerialPlan) and went.kv_keys  # nothing cached: P/D
    assert isinstance(planned([*ids, 7]), SerialPlan)  # D was sent it; it may not be there
    land_on_decode(went, rt.kv)
    again = planned([*ids, 7])
    assert isinstance(again, DecodeOnlyPlan) and again.decodes[0] == went.decodes[0]


@pytest.mark.parametrize(
    "setting",
    [
        {"kv_approximate": False},  # the operator turned it off
        {"policy": "prefix"},  # not kv_cache at all
    ],
)
def test_without_the_approximation_nothing_is_remembered_and_the_start_is_hashed(
    setting: dict[str, Any],
) -> None:
    rt = runtime(prefill=setting, decode={"endpoints": [D1, D2]})
    first, second = two_hashed_apart(SHARED, [P1, P2])
    for request in (first, second):
        with ExitStack() as inflight:
            went = plan(rt, request, inflight)
        assert went.prefill == hashed_to(request, [P1, P2])
    assert len(rt.kv.routed_bytes) == 0


def chat(messages: list[dict[str, str]], **fields: object) -> ClientRequest:
    raw = orjson.dumps({"model": "m", "messages": messages, **fields})
    return parse_request(Api.CHAT, raw, 1 << 20)


def test_a_chats_next_turn_is_credited_with_all_but_the_last_block_of_the_turn_before() -> None:
    """The next turn's `messages` start with the bytes of the last one's (its closing `]`
    aside); a chat with other `tools` is rendered otherwise: credited with nothing."""
    rt = runtime()
    turn1 = [
        {"role": "system", "content": "be brief " * 60},
        {"role": "user", "content": "first question"},
    ]
    answer = {"role": "assistant", "content": "an answer"}
    turn2 = [*turn1, answer, {"role": "user", "content": "q"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    with ExitStack() as inflight:
        went = plan(rt, chat(turn1), inflight)
    blocks = (len(dict(chat(turn1).parts)["messages"]) - 1) // 128  # full blocks before `]`
    wanted = pick_request(chat(turn2), None)
    held = approximated(rt, chat(turn2), wanted)
    assert held == {went.prefill: blocks * 32, went.decodes[0]: blocks * 32}
    assert approximated(rt, chat(turn2, tools=tools), wanted) == {}


def approximated(rt: Runtime, request: ClientRequest, wanted: Any) -> dict[str, int]:
    found = approximate(request, wanted, rt.kv, rt.config.decision.bytes_per_token)
    assert found is not None
    return dict(found[0].cached or {})
