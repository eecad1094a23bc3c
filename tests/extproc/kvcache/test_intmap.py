"""IntMap: a dict's answers through growth and shrinkage, values widened in place, and what its
memory estimate says against what it takes."""

from __future__ import annotations

import gc
import random
import tracemalloc
from array import array
from types import SimpleNamespace

import pytest

from extproc.kvcache import intmap
from extproc.kvcache.intmap import KEY_BITS, IntMap, column_code


def put(table: IntMap, key: int, value: int, extra: int = 0) -> None:
    bucket, position, found = table.locate(key)
    if found:
        table.values[bucket][position] = value
    else:
        table.insert(bucket, position, key, value, extra)


def remove(table: IntMap, key: int) -> None:
    bucket, position, found = table.locate(key)
    assert found
    table.delete(bucket, position)


def test_it_answers_as_a_dict_while_its_buckets_split_and_merge() -> None:
    rng = random.Random(1)
    table, model = IntMap("q", "I"), {}
    for step in range(40_000):
        if rng.random() < (0.7 if step < 20_000 else 0.2) or not model:
            key = rng.getrandbits(KEY_BITS)
            put(table, key, step, step % 7)
            model[key] = step
        else:
            key = rng.choice(list(model)) if step % 50 == 0 else next(iter(model))
            remove(table, key)
            del model[key]
        if step % 5000 == 4999:
            assert table.size == len(model)
            assert all(table.get(k) == v for k, v in model.items())
            assert table.get(rng.getrandbits(KEY_BITS)) is None
    assert len(table.keys) < 8  # merged back as it emptied
    for key, value in model.items():
        bucket, position, found = table.locate(key)
        assert found and table.extras[bucket][position] == value % 7


def test_values_widen_in_place_up_to_python_ints() -> None:
    table = IntMap(column_code(8))
    rng = random.Random(2)
    keys = [rng.getrandbits(KEY_BITS) for _ in range(600)]
    for n, key in enumerate(keys):
        put(table, key, n % 256)
    for bits in (16, 32, 64, 70):
        table.widen(column_code(bits))
    put(table, keys[0], 1 << 69)
    assert table.get(keys[0]) == 1 << 69
    assert [table.get(k) for k in keys[1:]] == [n % 256 for n in range(1, 600)]


def test_its_estimate_is_within_a_fifth_of_what_it_takes() -> None:
    rng = random.Random(3)
    keys = [rng.getrandbits(KEY_BITS) for _ in range(60_000)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table = IntMap("q", "I")
        for key in keys:
            put(table, key, key, 1)
        for key in keys[::3]:  # slack left by deletions counts too
            remove(table, key)
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert traced / table.size < 26  # 8 + 8 + 4 bytes a row, and slack
    assert abs(table.bytes_estimate() - traced) <= 0.2 * traced


def test_clearing_bits_everywhere_drops_the_keys_left_with_none() -> None:
    rng = random.Random(4)
    for code, bits in (("B", 1 << 3), ("H", 1 << 11 | 1), ("Q", 1 << 63), ("list", 1 << 70)):
        table, model = IntMap(code, "I"), {}
        for n in range(3000):
            key, value = rng.getrandbits(KEY_BITS), rng.choice([bits, bits | 2, 2, 5, bits])
            put(table, key, value, n)
            model[key] = (value, n)
        table.clear_bits(bits)
        left = {k: (v & ~bits, n) for k, (v, n) in model.items() if v & ~bits}
        assert table.size == len(left)
        for key in model:
            bucket, position, found = table.locate(key)
            assert found == (key in left)
            if found:
                got = (table.values[bucket][position], table.extras[bucket][position])
                assert got == left[key]


def test_clearing_bits_keeps_the_columns_compact_and_merges_only_below_the_threshold() -> None:
    table = IntMap("B")
    low = [n << 50 for n in range(1, 97)]  # 96 keys of the lower half, kept with value 2
    high = [(1 << 59) + (n << 50) for n in range(1, 162)]  # 161 of the upper half, cleared
    for key in (*low, *high):
        put(table, key, 3 if key in low else 1)
    assert len(table.keys) == 2  # 257 keys: split in two buckets (merged below 2 x 48)
    table.clear_bits(1)
    assert table.size == 96 and len(table.keys) == 2  # at the threshold: no merge
    assert [k.typecode for k in table.keys] == ["q", "q"]
    assert [v.typecode for v in table.values] == ["B", "B"]
    assert [table.get(key) for key in (*low, *high)] == [2] * 96 + [None] * 161
    remove(table, low[0])  # below it now: the buckets merge (keys of one type extend)
    assert len(table.keys) == 1 and table.get(low[1]) == 2


def test_bits_are_cleared_in_the_right_bytes_on_a_big_endian_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = array("Q", [2**64 - 1, 0x0123_4567_89AB_CDEF])
    laid_out = array("Q", values)
    laid_out.byteswap()  # the bytes a big-endian host holds
    monkeypatch.setattr(intmap, "sys", SimpleNamespace(byteorder="big"))
    bits = 0x0102_0000_0000_8001  # the two lowest and two highest bytes
    cleared = intmap._cleared(laid_out, intmap._byte_clearing("Q", bits))
    assert isinstance(cleared, array)
    cleared.byteswap()
    assert list(cleared) == [v & ~bits for v in values]


def test_deleting_merges_the_buckets_only_below_the_threshold() -> None:
    table = IntMap("B")
    keys = [n << 50 for n in range(1, 258)]  # 257 keys over the whole range: two buckets
    for key in keys:
        put(table, key, 1)
    for key in keys[96:]:
        remove(table, key)
    assert table.size == 96 and len(table.keys) == 2  # at the threshold (2 x 48): kept
    remove(table, keys[0])
    assert len(table.keys) == 1 and [table.get(k) for k in keys[1:96]] == [1] * 95


def test_a_column_is_the_narrowest_unsigned_type_the_bits_fit() -> None:
    widths = {1: "B", 8: "B", 9: "H", 16: "H", 17: "I", 32: "I", 33: "Q", 64: "Q", 65: "list"}
    assert {bits: column_code(bits) for bits in widths} == widths
    table = IntMap(column_code(64))  # a mask of 64 engines: the top bit set
    put(table, 1, 2**64 - 1)
    assert table.get(1) == 2**64 - 1


def test_the_buckets_split_only_above_their_mean_of_keys_and_in_halves() -> None:
    table = IntMap("B")
    keys = [n * ((1 << KEY_BITS) // 257) for n in range(257)]  # evenly over the range
    for key in keys[:256]:
        put(table, key, 1)
    assert len(table.keys) == 1  # 256 keys: at the mean, kept
    put(table, keys[256], 1)
    assert [len(bucket) for bucket in table.keys] == [129, 128]  # each half of the range
    assert [table.get(k) for k in keys] == [1] * 257
