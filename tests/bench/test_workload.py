"""The cache benchmark's workloads (bench/workload.py): the same seed gives the same requests,
every prompt has exactly the token count it claims, groups share their system prompt's ids,
and each turn of a conversation begins with the token ids of the turn before."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench.workload import (
    MultiTurn,
    SharedPrefix,
    multi_turn,
    random_words,
    shared_prefix,
    turn_waves,
)
from tests.support.tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE with a BOS and a role-header chat template, as the tiny model's."""
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def ids(model_dir: Path, text: str) -> list[int]:
    return list(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids)


def test_shared_prefix_is_seeded_and_token_exact(model_dir: Path) -> None:
    shape = SharedPrefix(groups=3, system_tokens=40, question_tokens=7, output_tokens=5)
    rows = shared_prefix(model_dir, shape, count=30, seed=3)
    assert rows == shared_prefix(model_dir, shape, count=30, seed=3)
    assert rows != shared_prefix(model_dir, shape, count=30, seed=4)
    assert {r["group"] for r in rows} == {0, 1, 2}
    heads: dict[int, set[tuple[int, ...]]] = {}
    for row in rows:
        prompt_ids = ids(model_dir, row["prompt"])
        assert len(prompt_ids) == row["prompt_tokens"] == 1 + 40 + 7
        assert row["output_tokens"] == 5
        heads.setdefault(row["group"], set()).add(tuple(prompt_ids[:41]))
    assert all(len(h) == 1 for h in heads.values())  # a group's system prompt: the same ids
    assert len({h.pop() for h in heads.values()}) == 3  # and groups differ
    assert len({r["prompt"] for r in rows}) == 30  # every question is new


def test_random_words_are_token_exact_and_share_no_block(model_dir: Path) -> None:
    """PR #187's plan, token-exact: every prompt its length with the BOS, and no two prompts
    share their first 16-token block (so no prefix-cache hit between them)."""
    rows = random_words(model_dir, 40, seed=2, input_tokens=64, output_tokens=9)
    assert rows == random_words(model_dir, 40, seed=2, input_tokens=64, output_tokens=9)
    assert rows != random_words(model_dir, 40, seed=3, input_tokens=64, output_tokens=9)
    prompts = [ids(model_dir, r["prompt"]) for r in rows]
    assert {len(p) for p in prompts} == {64} == {r["prompt_tokens"] for r in rows}
    assert {r["output_tokens"] for r in rows} == {9}
    assert len({tuple(p[:16]) for p in prompts}) == 40


def test_a_salt_changes_the_words_but_not_the_shape(model_dir: Path) -> None:
    shape = SharedPrefix(groups=4, system_tokens=20, question_tokens=4, output_tokens=3)
    one = shared_prefix(model_dir, shape, count=12, seed=5, salt="a")
    other = shared_prefix(model_dir, shape, count=12, seed=5, salt="b")
    assert [r["group"] for r in one] == [r["group"] for r in other]
    assert not {r["prompt"][:60] for r in one} & {r["prompt"][:60] for r in other}


def test_multi_turn_histories_grow_from_the_previous_turn(model_dir: Path) -> None:
    pytest.importorskip("jinja2")
    shape = MultiTurn(conversations=3, turns=4, system_tokens=30, user_tokens=9, answer_tokens=6)
    conversations = multi_turn(model_dir, shape, seed=8)
    assert conversations == multi_turn(model_dir, shape, seed=8)
    for turns in conversations:
        assert [t["turn"] for t in turns] == [0, 1, 2, 3]
        assert [m["role"] for m in turns[-1]["messages"]] == [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
        ]
        growth = set()
        for before, after in itertools.pairwise(turns):
            before_ids = ids(model_dir, before["prompt"])
            after_ids = ids(model_dir, after["prompt"])
            assert after_ids[: len(before_ids)] == before_ids
            assert after["messages"][: len(before["messages"])] == before["messages"]
            growth.add(len(after_ids) - len(before_ids))
        assert len(growth) == 1 and growth.pop() > 9 + 6  # answer + question + role headers
        for turn in turns:
            assert turn["prompt_tokens"] == len(ids(model_dir, turn["prompt"]))
            assert turn["prompt"].endswith("assistant:")
        sizes = {"system": 30, "user": 9, "assistant": 6}
        for message in turns[-1]["messages"]:  # each message's own tokens, after "role: "
            in_context = ids(model_dir, f"{message['role']}: {message['content']}\n")
            header = ids(model_dir, f"{message['role']}:") + ids(model_dir, "\n")[1:]
            assert len(in_context) - len(header) == sizes[message["role"]]
    waves = turn_waves(conversations)
    assert [[t["conversation"] for t in wave] for wave in waves] == [[0, 1, 2]] * 4
    assert all(t["turn"] == k for k, wave in enumerate(waves) for t in wave)
