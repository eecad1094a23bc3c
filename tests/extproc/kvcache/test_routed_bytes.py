"""What this sidecar sent where, by the prompt's raw bytes: leading blocks credited per engine,
scopes kept apart, and memory and hashing bounded whatever the prompts."""

from __future__ import annotations

import os
import tracemalloc

from extproc.kvcache.routed_bytes import RoutedBytes
from extproc.kvcache.scope import PLAIN, CacheScope

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
BLOCK = 128
SHARED = os.urandom(5 * BLOCK)


def test_an_engine_is_credited_with_the_leading_blocks_it_was_sent() -> None:
    routed = RoutedBytes()
    routed.remember([A], routed.keys(SHARED + b"first question" * 20))
    routed.remember([B], routed.keys(SHARED[: 2 * BLOCK] + b"elsewhere" * 40))
    second = routed.keys(SHARED + b"second question" * 20)
    assert routed.held(second) == {A: 5 * BLOCK, B: 2 * BLOCK}
    assert routed.held(second, [B, C]) == {B: 2 * BLOCK}
    assert routed.held(routed.keys(b"x" + SHARED)) == {}  # shared bytes, not leading ones
    assert routed.keys(SHARED[: BLOCK - 1]) == []  # no full block: nothing to credit


def test_what_was_sent_counts_as_reached_only_once_landed_there() -> None:
    routed = RoutedBytes()
    keys = routed.keys(SHARED)
    routed.remember([A, B], keys)
    assert routed.landed(keys) == {}  # sent, not there yet
    routed.land(A, keys[:3])
    routed.land(C, keys)  # never sent there: nothing
    assert routed.landed(keys) == {A: 3 * BLOCK}
    assert routed.landed(keys, [B, C]) == {}
    assert routed.held(keys) == {A: 5 * BLOCK, B: 5 * BLOCK}  # what was sent is unchanged
    routed.remember([A], keys)  # sent again: what reached it still has
    assert routed.landed(keys) == {A: 3 * BLOCK}
    routed.land(B, routed.keys(SHARED + os.urandom(BLOCK)))  # its last block never sent to B
    assert routed.landed(keys) == {A: 3 * BLOCK, B: 5 * BLOCK}


def test_a_block_not_kept_counts_for_no_engine_sent_or_landed() -> None:
    """The first engine's bits are the mask's lowest: a key not in the map must not read as
    one of them, whether looked up or landed."""
    routed = RoutedBytes()
    keys = routed.keys(SHARED)  # five blocks
    routed.remember([A], keys[:2])  # A takes the first slot
    routed.land(A, keys)  # the three A was never sent are not made up
    assert routed.held(keys) == routed.landed(keys) == {A: 2 * BLOCK}
    gap = [keys[0], routed.keys(b"z" * BLOCK)[0], keys[1]]
    assert routed.held(gap) == {A: BLOCK}  # the chain stops at the block not kept
    assert len(routed) == 2


def test_a_prompt_lands_only_on_the_engine_it_was_sent_to() -> None:
    routed = RoutedBytes()
    first, second = routed.keys(SHARED), routed.keys(b"y" * 5 * BLOCK)
    routed.remember([A], first)
    routed.remember([B], second)
    routed.land(B, first)  # B has a slot, but was not sent these
    assert routed.landed(first) == {}


def test_an_engine_forgotten_takes_what_reached_it_along() -> None:
    routed = RoutedBytes()
    keys = routed.keys(SHARED)
    routed.remember([A, B], keys)
    routed.land(A, keys)
    routed.land(B, keys)
    routed.forget(A)
    assert routed.landed(keys) == {B: 5 * BLOCK}
    routed.remember([C], keys)  # C takes A's bits: sent, not reached
    assert routed.landed(keys) == {B: 5 * BLOCK}


def test_a_salt_an_adapter_or_what_comes_ahead_keeps_a_prompt_apart() -> None:
    routed = RoutedBytes()
    salted, adapter = CacheScope(salt="s"), CacheScope(adapter="lora")
    routed.remember([A], routed.keys(SHARED))
    routed.remember([B], routed.keys(SHARED, salted))
    routed.remember([C], routed.keys(SHARED, PLAIN, b"tools=[1]"))
    assert routed.held(routed.keys(SHARED)) == {A: 5 * BLOCK}
    assert routed.held(routed.keys(SHARED, salted)) == {B: 5 * BLOCK}
    assert routed.held(routed.keys(SHARED, CacheScope(salt="t"))) == {}
    assert routed.held(routed.keys(SHARED, adapter)) == {}
    assert routed.held(routed.keys(SHARED, PLAIN, b"tools=[1]")) == {C: 5 * BLOCK}
    assert routed.held(routed.keys(SHARED, PLAIN, b"tools=[2]")) == {}


def test_a_huge_prompt_hashes_a_bounded_number_of_blocks() -> None:
    routed = RoutedBytes(max_blocks=256)
    huge = os.urandom(8 << 20)  # 8 MiB
    keys = routed.keys(huge, PLAIN, huge)  # and as much ahead of it
    assert len(keys) == 256
    assert routed.keys(huge[: 256 * BLOCK]) == routed.keys(huge, PLAIN, b"")[:256]
    routed.remember([A], keys)
    assert routed.held(routed.keys(huge[: 256 * BLOCK] + b"other tail")) == {}
    assert len(routed) == 256


def test_a_flood_of_distinct_prompts_stays_within_the_bound() -> None:
    """Entries never pass the bound, and their memory stays within ~130 bytes an entry
    (the key's int and the table's slots; a mask of few engines is a shared small int)."""
    bound = 20_000
    routed = RoutedBytes(max_entries=bound)
    engines = [f"10.0.0.{n}:8000" for n in range(8)]
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        last: list[int] = []
        for n in range(3_000):  # 3000 prompts of 16 blocks: 48 000 distinct blocks
            last = routed.keys(os.urandom(16 * BLOCK))
            routed.remember([engines[n % 8]], last)
            assert len(routed) <= bound
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(routed) > bound * 0.9  # full, not emptied
    assert used < 130 * bound, used
    assert routed.held(last) == {engines[2_999 % 8]: 16 * BLOCK}  # the newest kept


def test_the_deepest_blocks_go_first() -> None:
    """Past the bound, what goes first is the end of the least recently sent prompt, so a
    prompt keeps its leading blocks longest, as an engine's LRU keeps them."""
    routed = RoutedBytes(max_entries=64)
    old = routed.keys(os.urandom(16 * BLOCK))
    routed.remember([A], old)
    routed.remember([B], routed.keys(os.urandom(49 * BLOCK)))  # 65 entries: one batch goes
    assert len(routed) <= 64
    assert routed.held(old) == {A: 15 * BLOCK}


def test_an_engine_forgotten_leaves_every_entry_and_its_bit_is_reused() -> None:
    routed = RoutedBytes()
    only_a = routed.keys(b"a" * 3 * BLOCK)
    both = routed.keys(b"b" * 3 * BLOCK)
    routed.remember([A], only_a)
    routed.remember([A, B], both)
    routed.forget(A)
    assert routed.engines() == {B} and len(routed) == 3  # its own entries gone
    assert routed.held(only_a) == {} and routed.held(both) == {B: 3 * BLOCK}
    routed.remember([C], routed.keys(b"c" * BLOCK))  # C takes A's bit: none of A's credit
    assert routed.held(both) == {B: 3 * BLOCK} and routed.held(only_a) == {}
    routed.forget("never-seen")


def test_an_engine_forgotten_past_the_first_bit_leaves_its_entries_too() -> None:
    routed = RoutedBytes()
    only_b = routed.keys(b"b" * 2 * BLOCK)
    both = routed.keys(b"x" * 2 * BLOCK)
    routed.remember([A], routed.keys(b"a" * BLOCK))  # A has bit 0, B bit 1
    routed.remember([B], only_b)
    routed.remember([A, B], both)
    routed.forget(B)
    assert len(routed) == 3 and routed.held(both) == {A: 2 * BLOCK}
    routed.remember([C], routed.keys(b"c" * BLOCK))  # C takes B's bit: none of B's credit
    assert routed.held(only_b) == {} and routed.held(both) == {A: 2 * BLOCK}


def test_the_bound_is_reached_before_anything_goes() -> None:
    routed = RoutedBytes(max_entries=64)
    full = routed.keys(os.urandom(64 * BLOCK))
    routed.remember([A], full)
    assert len(routed) == 64 and routed.held(full) == {A: 64 * BLOCK}


def test_a_scope_with_a_lone_surrogate_still_keys_the_prompt() -> None:
    # a JSON string may escape half a surrogate pair: the scope is keyed, not refused
    routed = RoutedBytes()
    odd = CacheScope(salt="\ud800")
    routed.remember([A], routed.keys(SHARED, odd))
    assert routed.held(routed.keys(SHARED, odd)) == {A: 5 * BLOCK}
    assert routed.held(routed.keys(SHARED, CacheScope(salt="\ud801"))) == {}
