"""A batch's events cut into slices of bounded work: every slice within the bound, nothing lost
or reordered, and a long BlockStored cut so that the index chains its pieces as the whole."""

from __future__ import annotations

import itertools

import pytest

from extproc.kvcache.events import AllCleared, BlocksRemoved, BlocksStored, KvEvent
from extproc.kvcache.index import KvIndex
from extproc.kvcache.slices import slices

SIZE = 4


def chain(first: int, blocks: int, parent: int | None = None) -> BlocksStored:
    hashes = tuple(range(first, first + blocks))
    return BlocksStored(hashes, parent, tuple(range(first, first + blocks * SIZE)), SIZE, True)


def blocks(piece: list[KvEvent]) -> int:
    return sum(len(e.engine_hashes) if not isinstance(e, AllCleared) else 1 for e in piece)


@pytest.mark.parametrize("max_blocks", [1, 3, 64, 1000])
def test_every_slice_is_bounded_and_together_they_are_the_batch(max_blocks: int) -> None:
    events: list[KvEvent | None] = [
        chain(1, 130),
        None,
        BlocksRemoved(tuple(range(500, 700))),
        AllCleared(),
        chain(2000, 5, parent=130),
    ]
    pieces = list(slices(iter(events), max_blocks))
    assert all(blocks(piece) < 2 * max_blocks for piece in pieces)
    stored = [
        h for e in itertools.chain(*pieces) if isinstance(e, BlocksStored) for h in e.engine_hashes
    ]
    assert stored == [*range(1, 131), *range(2000, 2005)]
    removed = [
        h for e in itertools.chain(*pieces) if isinstance(e, BlocksRemoved) for h in e.engine_hashes
    ]
    assert removed == list(range(500, 700))
    if max_blocks < 100:
        assert len(pieces) > 335 // (2 * max_blocks)


def test_skipped_events_count_as_work() -> None:
    """A batch of nothing but unknown events still comes in slices (each a yield)."""
    assert list(slices(iter([None] * 10), 4)) == [[], [], []]


def test_a_long_block_stored_cut_in_pieces_is_indexed_as_the_whole() -> None:
    long, tail = chain(1, 100), chain(101, 2, parent=100)
    whole, pieces = KvIndex(1000), KvIndex(1000)
    whole.apply("e", [long, tail])
    for piece in slices(iter([long, tail]), 7):
        pieces.apply("e", piece)
    prompt = list(range(1, 1 + 100 * SIZE)) + list(range(101, 101 + 2 * SIZE))
    assert whole.longest_prefix(prompt) == pieces.longest_prefix(prompt) == {"e": 102}
    pieces.apply("e", [BlocksRemoved((50,))])
    assert pieces.longest_prefix(prompt) == {"e": 49}
