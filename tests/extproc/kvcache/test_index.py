"""The KV index: chains keyed by tokens, per-engine longest prefixes, removal, clearing, and its
bound under a flood of blocks."""

from __future__ import annotations

import random

import pytest

from extproc.kvcache.events import AllCleared, BlocksRemoved, BlocksStored
from extproc.kvcache.index import KvIndex, chain_keys

TOKENS = list(range(100, 132))  # 8 blocks of 4


def store(
    hashes: list[int],
    tokens: list[int],
    parent: int | None = None,
    size: int = 4,
    plain: bool = True,
) -> BlocksStored:
    return BlocksStored(tuple(hashes), parent, tuple(tokens), size, plain)


def test_longest_prefix_counts_leading_blocks_per_engine() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2, 3], TOKENS[:12])])
    index.apply("b", [store([9], TOKENS[:4]), store([8, 7], TOKENS[4:12], parent=9)])
    index.apply("c", [store([5], TOKENS[4:8])])  # block 2 alone: not a prefix
    index.add_engine("d")
    assert index.longest_prefix(TOKENS) == {"a": 3, "b": 3, "c": 0, "d": 0}
    assert index.longest_prefix(TOKENS[:10]) == {"a": 2, "b": 2, "c": 0, "d": 0}
    other = [*TOKENS[:4], 0, *TOKENS[5:]]
    assert index.longest_prefix(other) == {"a": 1, "b": 1, "c": 0, "d": 0}


def test_keys_depend_on_the_whole_prefix_not_the_block_alone() -> None:
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != chain_keys([0, 0, 0, 0, 5, 6, 7, 8], 4)[1]
    assert chain_keys(TOKENS, 4) == chain_keys([*TOKENS, 1, 2], 4)
    assert len(chain_keys(TOKENS, 4, limit=3)) == 3


def test_a_removed_block_ends_the_prefix_there() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2, 3], TOKENS[:12])])
    index.apply("a", [BlocksRemoved((2,))])
    assert index.longest_prefix(TOKENS) == {"a": 1}
    assert index.blocks == 2


def test_shared_blocks_stay_for_the_engine_that_still_holds_them() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2], TOKENS[:8])])
    index.apply("b", [store([11, 12], TOKENS[:8])])
    assert index.distinct_blocks == 2 and index.blocks == 4
    index.clear_engine("a")
    assert index.longest_prefix(TOKENS) == {"a": 0, "b": 2}
    index.apply("b", [AllCleared()])
    assert index.longest_prefix(TOKENS) == {"a": 0, "b": 0}
    assert index.blocks == 0 and index.distinct_blocks == 0


def test_blocks_without_a_known_parent_or_keyed_by_more_than_tokens_are_not_indexed() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([2], TOKENS[4:8], parent=1), store([3], TOKENS[:4], plain=False)])
    assert index.blocks == 0 and index.orphans == 2


def test_engines_with_other_block_sizes_are_looked_up_by_their_own() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2], TOKENS[:8])])
    index.apply("big", [store([1], TOKENS[:16], size=16)])
    assert index.longest_prefix(TOKENS) == {"a": 2, "big": 1}


def test_a_removed_engine_leaves_the_index_and_its_slot_is_reused() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2], TOKENS[:8])])
    index.apply("b", [store([1], TOKENS[:4])])
    index.remove_engine("a")
    assert index.engines() == ["b"] and index.blocks == 1
    index.apply("c", [store([1], TOKENS[:4])])  # takes a's bit: must not inherit a's blocks
    assert index.longest_prefix(TOKENS) == {"b": 1, "c": 1}


def test_the_bound_holds_under_a_flood_and_evicts_the_oldest_stored() -> None:
    index = KvIndex(max_blocks=1000)
    rng = random.Random(3)
    first = [rng.randrange(1000) for _ in range(32)]
    index.apply("a", [store(list(range(1, 9)), first)])
    next_hash = 100
    for n in range(2000):  # 16 000 blocks over two engines
        tokens = [rng.randrange(1000) for _ in range(32)]
        if n % 50 == 0:  # `first` reused now and then: vLLM stores it again, so it stays
            index.apply("a", [store(list(range(1, 9)), first)])
        index.apply("ab"[n % 2], [store(list(range(next_hash, next_hash + 8)), tokens)])
        next_hash += 8
        assert index.blocks <= 1000
    assert index.blocks > 900 and index.evicted > 14_000
    assert index.longest_prefix(first)["a"] == 8
    assert index.bytes_estimate() < 1000 * 400


def test_a_block_stored_again_under_another_chain_moves() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1], TOKENS[:4])])
    index.apply("a", [store([1], TOKENS[4:8])])  # the engine reused its hash for other tokens
    assert index.longest_prefix(TOKENS) == {"a": 0}
    assert index.longest_prefix(TOKENS[4:]) == {"a": 1}
    assert index.blocks == 1 and index.distinct_blocks == 1


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        KvIndex(max_blocks=0)
