"""The lab's workloads: Mooncake traces (equal hash ids, equal prefixes) and the generators."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lab import workloads
from lab.workloads import MOONCAKE_BLOCK, TraceError, generate, read_mooncake
from tests.support.lab import mooncake_trace, shared_block_trace


def test_equal_hash_ids_are_equal_prefixes(tmp_path: Path) -> None:
    trace = mooncake_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]},
            {"timestamp": 30, "input_length": 1200, "output_length": 6, "hash_ids": [7, 9, 10]},
            {"timestamp": 10, "input_length": 1100, "output_length": 7, "hash_ids": [8]},
        ],
    )
    workload = read_mooncake(trace, speedup=2.0)
    assert [c.at for c in workload.chains] == [0.0, 0.005, 0.015]  # in time order, 2 x
    first, third, second = (c.requests[0] for c in workload.chains)
    assert [len(r.prompt) for r in (first, second, third)] == [1000, 1200, 1100]
    assert [r.output_tokens for r in (first, second, third)] == [5, 6, 7]
    assert first.prompt[:MOONCAKE_BLOCK] == second.prompt[:MOONCAKE_BLOCK]  # block 7
    assert first.prompt[MOONCAKE_BLOCK:1000] != second.prompt[MOONCAKE_BLOCK:1000]
    # block 8 is the same tokens wherever it sits; past its one block the prompt is its own
    assert third.prompt[: 1000 - MOONCAKE_BLOCK] == first.prompt[MOONCAKE_BLOCK:1000]
    assert third.prompt[MOONCAKE_BLOCK:] != second.prompt[MOONCAKE_BLOCK:1100]
    assert read_mooncake(trace).chains[1].requests[0].prompt == third.prompt  # reproducible


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "t.jsonl:1: not JSON"),
        ('{"timestamp": 0, "input_length": 10}', "'output_length' must be"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1}', "'timestamp' must be"),
    ],
)
def test_a_bad_trace_line_is_named(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=says):
        read_mooncake(path)


def test_the_seed_plan_is_two_c_random_prompts_at_concurrency_c() -> None:
    workload = generate("seed", seed=1, concurrency=4)
    assert (workload.open_loop, workload.concurrency, workload.requests) == (False, 4, 8)
    prompts = [c.requests[0] for c in workload.chains]
    assert {(len(r.prompt), r.output_tokens) for r in prompts} == {(1024, 64)}
    assert len({tuple(r.prompt) for r in prompts}) == 8
    assert generate("seed", seed=1, concurrency=4) == workload
    assert generate("seed", seed=2, concurrency=4) != workload


def test_shared_prefix_requests_share_their_groups_system_prompt() -> None:
    requests = [c.requests[0] for c in generate("shared-prefix", 1, concurrency=2).chains]
    systems = {tuple(r.prompt[: 1 + 1024]) for r in requests}
    assert len(systems) == 8  # the default shape's groups
    assert {len(r.prompt) for r in requests} == {1 + 1024 + 64}


def test_a_conversations_turns_extend_the_one_before() -> None:
    chains = generate("multi-turn", 1, concurrency=2, count=12).chains
    assert [len(c.requests) for c in chains] == [6, 6]
    turns = chains[0].requests
    for before, after in itertools.pairwise(turns):
        assert after.prompt[: len(before.prompt)] == before.prompt
        assert len(after.prompt) == len(before.prompt) + 64 + 96  # its answer, a new message
    assert {t.session for t in turns} == {"conv-0"}


def test_open_loop_at_a_rate_spreads_the_chains_in_time() -> None:
    workload = generate("mixed", 1, rate=10.0, count=200)
    times = [c.at for c in workload.chains]
    assert workload.open_loop and times == sorted(times) and times[0] == 0.0
    assert 15 < times[-1] < 25  # 199 gaps of 0.1 s on average
    lengths = sorted(len(c.requests[0].prompt) for c in workload.chains)
    assert lengths[0] >= 16 and lengths[-1] <= 4096 and lengths[100] < 600  # heavy-tailed


def test_a_generator_takes_one_loop() -> None:
    with pytest.raises(ValueError, match="--concurrency"):
        generate("seed", 1)
    with pytest.raises(ValueError, match="--concurrency"):
        generate("seed", 1, concurrency=2, rate=1.0)


def test_a_traces_prompts_are_made_when_sent_not_held(tmp_path: Path) -> None:
    """Reading a trace holds no prompt (a long trace's would take gigabytes): each is made
    from its blocks when asked, the same each time."""
    workloads._block.cache_clear()
    trace = mooncake_trace(tmp_path / "t.jsonl", shared_block_trace(6))
    requests = [c.requests[0] for c in read_mooncake(trace).chains]
    assert workloads._block.cache_info().currsize == 0
    assert requests[0].prompt == requests[0].prompt
    assert workloads._block.cache_info().currsize == 2  # its two blocks
