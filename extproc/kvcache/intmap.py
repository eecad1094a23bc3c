"""A compact map from 60-bit int keys to machine ints: sorted arrays in buckets.

A dict of int to int spends about 100 bytes an entry (two int objects and a slot of three
words, a third of the slots empty); here an entry costs its key's 8 bytes, its values' bytes
and a little slack. Keys must be spread evenly over [0, 2**60) (random, or mixed by the
caller): a key's bucket is its top bits. A bucket holds about 48-256 keys, found by bisection
and moved by memmove, both in C; as the map grows (or shrinks) all buckets split (or pairs
merge) at once by slicing, so no key is ever rehashed one by one.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable
from itertools import compress
from typing import TypeAlias

__all__ = ["ARRAY_BYTES", "KEY_BITS", "Column", "IntMap", "column_code"]

KEY_BITS = 60
_SPLIT_AT = 256  # mean keys a bucket above which every bucket splits in two
_MERGE_AT = 48  # ... below which pairs merge back
_LIST = "list"  # a column of Python ints, for values wider than 64 bits
_EMPTY = sys.getsizeof(array("q"))
ARRAY_BYTES = _EMPTY + 8  # an empty array, and its slot in a list
_INT_BYTES = 36  # an int over 2**60 (in a list column: masks of more than 64 engines)

Column: TypeAlias = "array[int] | list[int]"


def column_code(bits: int) -> str:
    """The narrowest column type whose values hold `bits` bits."""
    for code in ("B", "H", "I", "Q"):
        if array(code).itemsize * 8 >= bits:
            return code
    return _LIST


def _column(code: str, values: Iterable[int] = ()) -> Column:
    return list(values) if code == _LIST else array(code, values)


class IntMap:
    """`key -> value`, and an `extra` value per key where an extra type code is given (type
    codes of `array`, or "list" for Python ints; `extras` is empty without one).

    `locate` gives a key's (bucket, position, found); values are read and written in place as
    `values[bucket][position]` (`extras[...]`). A position is good until the next insert or
    delete."""

    __slots__ = (
        "_codes",
        "_merge_below",
        "_split_above",
        "extras",
        "keys",
        "shift",
        "size",
        "values",
    )

    def __init__(self, value_code: str, extra_code: str | None = None) -> None:
        self._codes = [value_code] if extra_code is None else [value_code, extra_code]
        self.shift = KEY_BITS  # a key's bucket is key >> shift
        self.keys: list[Column] = [array("q")]
        self.values: list[Column] = [_column(value_code)]
        self.extras: list[Column] = [] if extra_code is None else [_column(extra_code)]
        self.size = 0
        self._limits()

    def locate(self, key: int) -> tuple[int, int, bool]:
        bucket = key >> self.shift
        keys = self.keys[bucket]
        position = bisect_left(keys, key)
        return bucket, position, position < len(keys) and keys[position] == key

    def get(self, key: int) -> int | None:
        bucket = key >> self.shift
        keys = self.keys[bucket]
        position = bisect_left(keys, key)
        if position < len(keys) and keys[position] == key:
            return self.values[bucket][position]
        return None

    def insert(self, bucket: int, position: int, key: int, value: int, extra: int = 0) -> None:
        """Add `key` where `locate` said it goes (it must not be held)."""
        self.keys[bucket].insert(position, key)
        self.values[bucket].insert(position, value)
        if self.extras:
            self.extras[bucket].insert(position, extra)
        self.size += 1
        if self.size > self._split_above:
            self._split()

    def delete(self, bucket: int, position: int) -> None:
        keys = self.keys[bucket]
        del keys[position]
        del self.values[bucket][position]
        if self.extras:
            del self.extras[bucket][position]
        self.size -= 1
        if self.size < self._merge_below:
            self._merge()
        elif not len(keys) % 16 and sys.getsizeof(keys) > _EMPTY + 10 * len(keys) + 128:
            self._trim(bucket)  # an array keeps its room as it shrinks by one: give it back

    def _trim(self, bucket: int) -> None:
        for parts in self._columns():
            parts[bucket] = parts[bucket][:]  # a copy is allocated to its size

    def clear_bits(self, bits: int) -> None:
        """`value &= ~bits` for every key, and the keys whose value is then 0 go: a pass over
        whole buckets in C (bytes.translate over each byte of the values, then filtering),
        cheaper than one key at a time once a good share of the keys changes."""
        code = self._codes[0]
        clear = _byte_clearing(code, bits)
        for bucket, values in enumerate(self.values):
            cleared = [v & ~bits for v in values] if clear is None else _cleared(values, clear)
            if 0 in cleared:
                self.keys[bucket] = array("q", compress(self.keys[bucket], cleared))
                if self.extras:
                    kept = compress(self.extras[bucket], cleared)
                    self.extras[bucket] = _column(self._codes[1], kept)
                cleared = _column(code, filter(None, cleared))
            self.values[bucket] = cleared
        self.size = sum(len(keys) for keys in self.keys)
        while self.size < self._merge_below:
            self._merge()

    def widen(self, code: str) -> None:
        """Give the values a wider type, keeping them."""
        if code != self._codes[0]:
            self._codes[0] = code
            self.values = [_column(code, part) for part in self.values]

    def bytes_estimate(self) -> int:
        """Memory without walking the buckets: each array's header, the elements, and the
        slack arrays keep (up to a sixteenth and 7 elements as they grow, up to a quarter as
        they shrink before `delete` trims them: about a tenth on average)."""
        row = 8 + sum(
            (8 + _INT_BYTES) if code == _LIST else array(code).itemsize for code in self._codes
        )
        arrays = len(self.keys) * (1 + len(self._codes))
        return int(self.size * row * (1 + 1 / 10)) + arrays * (ARRAY_BYTES + 4 * 8)

    def _columns(self) -> list[list[Column]]:
        return [self.keys, self.values] + ([self.extras] if self.extras else [])

    def _set_columns(self, columns: list[list[Column]]) -> None:
        self.keys, self.values = columns[0], columns[1]
        if self.extras:
            self.extras = columns[2]
        self._limits()

    def _limits(self) -> None:
        buckets = len(self.keys)
        self._split_above = _SPLIT_AT * buckets
        self._merge_below = _MERGE_AT * buckets if buckets > 1 else -1

    def _split(self) -> None:
        self.shift -= 1
        shift = self.shift
        cuts = [
            bisect_left(keys, (2 * bucket + 1) << shift) for bucket, keys in enumerate(self.keys)
        ]
        self._set_columns([_halves(parts, cuts) for parts in self._columns()])

    def _merge(self) -> None:
        self.shift += 1
        self._set_columns([_pairs(parts) for parts in self._columns()])


def _byte_clearing(code: str, bits: int) -> list[tuple[int, bytes]] | None:
    """For an array of `code`: (offset of a byte in an item, its translation table) for each
    byte that `bits` touches; None for a list."""
    if code == _LIST:
        return None
    size = array(code).itemsize
    out = []
    for byte in range(size):
        clear = bits >> (8 * byte) & 0xFF
        if clear:
            offset = byte if sys.byteorder == "little" else size - 1 - byte
            out.append((offset, bytes(i & ~clear for i in range(256))))
    return out


def _cleared(values: Column, clearing: list[tuple[int, bytes]]) -> Column:
    assert isinstance(values, array)
    copy = values[:]
    raw, size = memoryview(copy).cast("B"), copy.itemsize
    for offset, table in clearing:
        raw[offset::size] = bytes(raw[offset::size]).translate(table)
    return copy


def _halves(parts: list[Column], cuts: list[int]) -> list[Column]:
    out: list[Column] = []
    for part, cut in zip(parts, cuts, strict=True):
        out.append(part[:cut])
        out.append(part[cut:])
    return out


def _pairs(parts: list[Column]) -> list[Column]:
    out: list[Column] = []
    for low, high in zip(parts[::2], parts[1::2], strict=True):
        low.extend(high)
        out.append(low)
    return out
