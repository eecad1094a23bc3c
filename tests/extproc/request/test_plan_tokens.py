"""The plan's KV-routing part: the token ids a request is routed by (chat options and all), and
what `plan_request` does with them (the pick, where its blocks went), its fallbacks, its
gateway subset and its size check."""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from extproc.errors import ClientError
from extproc.kvcache.events import BlocksStored
from extproc.metrics import Metrics
from extproc.request.parse import Api, parse_request
from extproc.request.plan import (
    DecodeOnlyPlan,
    SerialPlan,
    pick_request,
    plan_request,
    request_tokens,
)
from extproc.roles import Role
from extproc.scheduling.pool import Pool
from extproc.scheduling.scheduler import Scheduler, pool_picker
from extproc.scheduling.subset_hint import Subset
from extproc.wiring import Runtime
from tests.support.routing import fixed_routing_config

P1, P2 = "127.0.0.1:8101", "127.0.0.1:8102"
D1, D2, D3 = "127.0.0.1:8201", "127.0.0.1:8202", "127.0.0.1:8203"
SPECIAL = ["<unk>", "<user>", "<assistant>", "<tools>", "<flag>"]
WORD = {w: i for i, w in enumerate([*SPECIAL, *(f"w{i}" for i in range(64))])}
# Each chat option shows in the text: tools, a template kwarg, the generation prompt; `fail`
# makes the template raise.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if tools %}<tools> {% endif %}{% if flag %}<flag> {% endif %}"
    "{% if fail %}{{ raise_exception('the template refuses') }}{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    tokenizer = Tokenizer(models.WordLevel(WORD, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return tmp_path


def ids(text: str) -> list[int]:
    return [WORD[w] for w in text.split()]


def runtime(model_dir: Path, **extra: Any) -> Runtime:
    pools = {
        "prefill": {"endpoints": [P1, P2], "kv_events": {}},
        "decode": {"endpoints": [D1], "kv_events": {}},
    }
    rt = Runtime(fixed_routing_config(pools | {"tokenizer": str(model_dir)} | extra), "unix:/x")
    rt.kv.learn_base_model(D1, "m")  # as the scraper learns it: "m" is no LoRA adapter
    return rt


async def tokens_of(rt: Runtime, api: Api, doc: dict[str, Any]) -> list[int] | None:
    request = parse_request(api, orjson.dumps({"model": "m", **doc}), 1 << 20)
    return await request_tokens(request, rt.scheduler)


USER = [{"role": "user", "content": "w0 w1"}]


@pytest.mark.parametrize(
    ("doc", "text"),
    [
        ({"messages": USER}, "<user> w0 w1 <assistant>"),
        ({"messages": USER, "add_generation_prompt": False}, "<user> w0 w1"),
        ({"messages": USER, "add_generation_prompt": None}, "<user> w0 w1 <assistant>"),
        (
            {
                "messages": [*USER, {"role": "assistant", "content": "w2 w3"}],
                "continue_final_message": True,
            },
            "<user> w0 w1 <assistant> w2 w3",
        ),
        ({"messages": USER, "continue_final_message": 1}, "<user> w0 w1 <assistant>"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "<user> w0 w1 <tools> <assistant>"),
        ({"messages": USER, "tools": {"type": "function"}}, "<user> w0 w1 <assistant>"),
        (
            {"messages": USER, "chat_template_kwargs": {"flag": True}},
            "<user> w0 w1 <flag> <assistant>",
        ),
        ({"messages": USER, "chat_template_kwargs": ["flag"]}, "<user> w0 w1 <assistant>"),
    ],
    ids=[
        "generation-prompt",
        "no-generation-prompt",
        "generation-prompt-null",
        "continue-final",
        "continue-needs-true",
        "tools",
        "tools-not-a-list",
        "template-kwargs",
        "template-kwargs-not-a-dict",
    ],
)
async def test_a_chat_is_tokenized_with_the_clients_template_options(
    model_dir: Path, doc: dict[str, Any], text: str
) -> None:
    rt = runtime(model_dir)
    assert await tokens_of(rt, Api.CHAT, doc) == ids(text)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("w3 w4", ids("w3 w4")),
        ([7, 8, 9], [7, 8, 9]),
    ],
    ids=["text", "token-ids"],
)
async def test_a_completion_is_tokenized_as_text_or_taken_as_ids(
    model_dir: Path, prompt: object, expected: list[int] | None
) -> None:
    rt = runtime(model_dir)
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": prompt}) == expected


async def test_a_template_that_fails_routes_without_tokens_and_says_why_in_the_debug_log(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rt = runtime(model_dir)
    doc = {"messages": USER, "chat_template_kwargs": {"fail": True}}
    with caplog.at_level(logging.DEBUG, logger="extproc"):
        assert await tokens_of(rt, Api.CHAT, doc) is None
    [record] = [r for r in caplog.records if "tokenized" in r.getMessage()]
    assert record.getMessage() == (
        "request not tokenized for the KV index: the chat template failed: the template refuses"
    )


async def test_only_the_requests_own_model_group_decides_whether_it_is_tokenized(
    model_dir: Path,
) -> None:
    group = {
        "prefill": {"endpoints": [P2], "kv_events": {}},
        "decode": {"endpoints": [D2], "kv_events": {}},
        "tokenizer": str(model_dir),
    }
    config = {"prefill": {"endpoints": [P1]}, "decode": {"endpoints": [D1]}, "models": {"m": group}}
    rt = Runtime(fixed_routing_config(config), "unix:/x")
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": "w1 w2"}) == ids("w1 w2")
    request = parse_request(Api.COMPLETIONS, b'{"model": "other", "prompt": "w1"}', 1 << 20)
    assert await request_tokens(request, rt.scheduler) is None


async def test_a_scheduler_without_kv_routing_tokenizes_nothing(model_dir: Path) -> None:
    cfg = fixed_routing_config({"prefill": {"endpoints": [P1]}, "decode": {"endpoints": [D1]}})
    prefill = Pool(Role.PREFILL, cfg.static_addresses(Role.PREFILL), pool_picker(cfg.prefill))
    decode = Pool(Role.DECODE, cfg.static_addresses(Role.DECODE), pool_picker(cfg.decode))
    scheduler = Scheduler(cfg, prefill, decode, Metrics(), None)
    request = parse_request(Api.COMPLETIONS, b'{"model": "m", "prompt": "w1"}', 1 << 20)
    assert await request_tokens(request, scheduler) is None


# ---- plan_request with tokens ------------------------------------------------------------------

LONG = " ".join(f"w{i}" for i in range(48))  # several blocks of any block size up to 16


def completion(prompt: str = LONG, **fields: object) -> Any:
    raw = orjson.dumps({"model": "m", "prompt": prompt, **fields})
    return parse_request(Api.COMPLETIONS, raw, 1 << 20)


async def test_a_kv_routed_plan_remembers_where_its_blocks_went(model_dir: Path) -> None:
    rt = runtime(model_dir)
    request = completion()
    tokens = await request_tokens(request, rt.scheduler)
    assert tokens is not None
    assert rt.kv.lookup(tokens).by_endpoint == {}
    with ExitStack() as inflight:
        plan = plan_request(
            request, {}, rt.config, rt.scheduler, rt.identities, inflight, tokens=tokens
        )
    assert isinstance(plan, SerialPlan)
    held = rt.kv.lookup(tokens).by_endpoint
    assert set(held) == {plan.prefill, D1} and held[D1] > 0 and held[plan.prefill] == held[D1]


async def test_a_plan_without_tokens_remembers_nothing(model_dir: Path) -> None:
    rt = runtime(model_dir)
    request = completion()
    tokens = await request_tokens(request, rt.scheduler)
    assert tokens is not None
    with ExitStack() as inflight:
        plan_request(request, {}, rt.config, rt.scheduler, rt.identities, inflight)
    assert rt.kv.lookup(tokens).by_endpoint == {}


async def test_the_pick_sees_what_each_engine_holds_of_the_tokens(model_dir: Path) -> None:
    prefill = {"endpoints": [P1, P2], "kv_events": {}, "policy": "kv_cache"}
    rt = runtime(model_dir, prefill=prefill)
    holders = [P1, P2, P2, P1, P2, P1]  # not what hashing the prompts would give, by chance
    requests = [completion(" ".join(f"w{(9 * n + i) % 64}" for i in range(32))) for n in range(6)]
    tokens = [await request_tokens(request, rt.scheduler) for request in requests]
    for holder, ids_ in zip(holders, tokens, strict=True):
        assert ids_ is not None
        rt.kv.remember([holder], ids_)  # sent this prompt before: it probably holds it
    for holder, request, ids_ in zip(holders, requests, tokens, strict=True):
        with ExitStack() as inflight:
            plan = plan_request(
                request, {}, rt.config, rt.scheduler, rt.identities, inflight, tokens=ids_
            )
        assert isinstance(plan, SerialPlan) and plan.prefill == holder


@pytest.mark.parametrize(
    ("fields", "decode_only"),
    [
        ({}, True),  # D holds the prompt: nothing left to prefill
        ({"cache_salt": "mine"}, False),  # vLLM would not reuse D's blocks for it
        ({"model": "m-lora"}, False),  # nor for a LoRA adapter
    ],
)
async def test_only_blocks_of_the_requests_own_scope_make_it_decode_only(
    model_dir: Path, fields: dict[str, Any], decode_only: bool
) -> None:
    """Threshold mode: a long prompt D holds goes decode-only; the same prompt salted, or for
    an adapter, is not credited with D's blocks and goes through P."""
    rt = runtime(model_dir, decision={"mode": "threshold", "max_prompt_tokens": 8})
    tokens = await request_tokens(completion(), rt.scheduler)
    assert tokens is not None and len(tokens) == 48
    hashes = list(range(1, 4))
    stored = BlocksStored(tuple(hashes), None, tuple(tokens), 16, True)
    rt.kv.index.apply(D1, [stored])  # D1's events: it holds the whole prompt
    request = completion(**fields)
    with ExitStack() as inflight:
        plan = plan_request(
            request, {}, rt.config, rt.scheduler, rt.identities, inflight, tokens=tokens
        )
    assert isinstance(plan, DecodeOnlyPlan) is decode_only


def test_pick_request_carries_the_model_session_priority_and_prompt() -> None:
    request = completion("w1 w2")
    wanted = pick_request(request, "s1", 3)
    assert (wanted.model, wanted.session, wanted.priority) == ("m", "s1", 3)
    assert wanted.prefix == b'"prompt":"w1 w2"'
    assert pick_request(request, None).priority == 0


async def test_pick_request_with_tokens_counts_what_the_tokenizer_left_out(model_dir: Path) -> None:
    rt = runtime(model_dir)
    request = completion("w1 w2", suffix="w3 w4")
    tokens = await request_tokens(request, rt.scheduler)
    assert tokens is not None
    wanted = pick_request(request, "s1", 2, tokens, rt.kv)
    assert (wanted.model, wanted.session, wanted.priority) == ("m", "s1", 2)
    assert wanted.prompt_tokens == 2 and wanted.cached == {}
    untokenized = pick_request(request, "s1", 2).prompt_bytes
    assert 0 < wanted.prompt_bytes < untokenized


def test_a_plan_has_one_fallback_d_by_default_and_as_many_as_asked() -> None:
    rt = Runtime(
        fixed_routing_config(
            {"prefill": {"endpoints": [P1]}, "decode": {"endpoints": [D1, D2, D3]}}
        ),
        "unix:/x",
    )
    with ExitStack() as inflight:
        one = plan_request(completion(), {}, rt.config, rt.scheduler, rt.identities, inflight)
        two = plan_request(
            completion(), {}, rt.config, rt.scheduler, rt.identities, inflight, fallbacks=2
        )
    assert len(one.decodes) == 2 and len(two.decodes) == 3


def test_a_gateways_subset_bounds_the_plan() -> None:
    rt = Runtime(
        fixed_routing_config(
            {"prefill": {"endpoints": [P1, P2]}, "decode": {"endpoints": [D1, D2]}}
        ),
        "unix:/x",
    )
    subset = Subset.of([P2, D2])
    for _ in range(3):
        with ExitStack() as inflight:
            plan = plan_request(
                completion(), {}, rt.config, rt.scheduler, rt.identities, inflight, subset
            )
        assert isinstance(plan, SerialPlan) and (plan.prefill, plan.decodes[0]) == (P2, D2)


def test_a_decode_only_plan_carries_ds_count() -> None:
    config = {"prefill": {"endpoints": [P1]}, "decode": {"endpoints": [D1]}}
    rt = Runtime(
        fixed_routing_config(config | {"dispatch": {"no_healthy_prefill": "decode_only"}}),
        "unix:/x",
    )
    rt.prefill.set_healthy(P1, False)
    with ExitStack() as inflight:
        plan = plan_request(completion(), {}, rt.config, rt.scheduler, rt.identities, inflight)
        assert isinstance(plan, DecodeOnlyPlan) and plan.decode_counted is not None
        assert plan.decode_counted.state.address == D1 and plan.decode_rank is None


def test_plan_request_refuses_a_body_over_envoys_buffer() -> None:
    config = {"prefill": {"endpoints": [P1]}, "decode": {"endpoints": [D1]}}
    rt = Runtime(fixed_routing_config(config | {"limits": {"max_body_bytes": 65536}}), "unix:/x")
    with ExitStack() as inflight, pytest.raises(ClientError) as caught:
        plan_request(
            completion("w1 " * 70_000), {}, rt.config, rt.scheduler, rt.identities, inflight
        )
    assert caught.value.status == 413


@pytest.mark.parametrize("wrong", [len(WORD), 2**31 - 1])
async def test_token_ids_outside_the_vocabulary_are_refused(model_dir: Path, wrong: int) -> None:
    rt = runtime(model_dir)
    with pytest.raises(ClientError) as caught:
        await tokens_of(rt, Api.COMPLETIONS, {"prompt": [1, wrong, 2]})
    assert caught.value.status == 400
    assert orjson.loads(caught.value.body)["error"]["message"] == (
        f"'prompt' holds token id {wrong}, outside the model's vocabulary (ids 0 to "
        f"{len(WORD) - 1}); send ids the model's tokenizer gives"
    )
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": [0, len(WORD) - 1]}) == [
        0,
        len(WORD) - 1,
    ]


async def test_a_prompt_longer_than_any_engine_of_its_group_runs_is_not_tokenized(
    model_dir: Path,
) -> None:
    rt = runtime(model_dir)
    prompt = "w1 " * 30  # 30 tokens
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": prompt}) == ids(prompt)
    rt.kv.context_length("", 29)  # what an engine of the group said
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": prompt}) is None
    rt.kv.context_length("", 30)  # the longest any engine of the group runs
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": prompt}) == ids(prompt)


# ---- a prompt that fits no engine ----------------------------------------------------------------

BYTES = pre_tokenizers.ByteLevel.alphabet()


@pytest.fixture
def bpe_dir(tmp_path: Path) -> Path:
    """A byte-level BPE whose longest token is 4 characters: a text of n characters is at
    least n / 4 tokens."""
    vocab = {c: i for i, c in enumerate([*BYTES, "wx", "yz", "wxyz"])}
    tokenizer = Tokenizer(models.BPE(vocab, [("w", "x"), ("y", "z"), ("wx", "yz")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def told(rt: Runtime, tokens: int, engines: tuple[str, ...] = (P1, P2, D1)) -> None:
    for engine in engines:
        rt.kv.engine_context(engine, tokens)


async def test_a_prompt_provably_longer_than_every_engines_context_is_refused_untokenized(
    bpe_dir: Path,
) -> None:
    rt = runtime(bpe_dir)
    told(rt, 10)
    told(rt, 12, (D1,))  # the longest any engine of the group runs
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": "a" * 48}) == [BYTES.index("a")] * 48
    with pytest.raises(ClientError) as caught:
        await tokens_of(rt, Api.COMPLETIONS, {"prompt": "wxyz" * 12 + "a"})  # 13 tokens at least
    assert caught.value.status == 400
    assert orjson.loads(caught.value.body)["error"] == {
        "message": "This model's maximum context length is 12 tokens. However, the prompt is "
        "at least 13 tokens; shorten the prompt",
        "type": "BadRequestError",
        "param": "prompt",
        "code": 400,
    }


async def test_nothing_is_refused_while_one_engine_of_the_group_has_not_said_its_length(
    bpe_dir: Path,
) -> None:
    rt = runtime(bpe_dir)
    told(rt, 10, (P1, D1))  # P2 has not said
    long = "wxyz" * 30
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": long}) is not None
    told(rt, 10, (P2,))
    with pytest.raises(ClientError):
        await tokens_of(rt, Api.COMPLETIONS, {"prompt": long})
    rt.kv.engine_context(P2, None)  # it went down: it may come back longer
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": long}) is not None


async def test_a_tokenizer_that_can_drop_characters_refuses_no_text(model_dir: Path) -> None:
    """Whitespace splitting drops the spaces and a word-level model makes any unknown word one
    token: no character count bounds the tokens. A list of ids is its own count."""
    rt = runtime(model_dir)
    told(rt, 3)
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": "w1" + " " * 100 + "w2"}) == ids("w1 w2")
    with pytest.raises(ClientError) as caught:
        await tokens_of(rt, Api.COMPLETIONS, {"prompt": [1, 2, 3, 4]})
    assert (
        "maximum context length is 3 tokens" in orjson.loads(caught.value.body)["error"]["message"]
    )
    assert await tokens_of(rt, Api.COMPLETIONS, {"prompt": [1, 2, 3]}) == [1, 2, 3]


async def test_a_chat_is_not_refused_on_its_length(bpe_dir: Path) -> None:
    """A template may leave text out: the messages' characters bound nothing."""
    rt = runtime(bpe_dir)
    told(rt, 1)
    request = parse_request(
        Api.CHAT,
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * 99}]}),
        1 << 20,
    )
    assert await request_tokens(request, rt.scheduler) is None  # no template: no ids, no 400
