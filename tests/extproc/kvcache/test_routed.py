"""Where routed prompts' blocks went: bounded at max_blocks, the oldest routed dropped first,
in batches."""

from __future__ import annotations

from extproc.kvcache.routed import BLOCK_SIZE, RoutedBlocks


def test_the_bound_holds_exactly_max_blocks_and_drops_the_oldest_batch_beyond() -> None:
    routed = RoutedBlocks(max_blocks=128)
    chain = list(range(128))
    routed.remember("a", chain)
    assert len(routed) == 128  # at the bound: nothing dropped
    assert routed.held(chain, ["a"]) == {"a": 128 * BLOCK_SIZE}
    routed.remember("b", [1000])
    # one over: the oldest 128 // 64 = 2 go, not more
    assert len(routed) == 127
    assert routed.held(chain, ["a"]) == {}  # its first block is gone
    assert routed.held(chain[2:], ["a"]) == {"a": 126 * BLOCK_SIZE}
    assert routed.held([1000], ["b"]) == {"b": BLOCK_SIZE}


def test_blocks_count_as_reached_once_landed_and_stay_so_when_sent_again() -> None:
    routed = RoutedBlocks(max_blocks=128)
    routed.remember("d", [1, 2, 3])
    assert routed.held([1, 2, 3], ["d"]) == {"d": 3 * BLOCK_SIZE}
    assert routed.held([1, 2, 3], ["d"], reached=True) == {}  # sent, not there yet
    routed.land("d", [1, 2])
    routed.land("e", [1, 2])  # never sent there: nothing
    assert routed.held([1, 2, 3], ["d", "e"], reached=True) == {"d": 2 * BLOCK_SIZE}
    routed.remember("d", [1, 2, 3, 4])  # sent again: what had reached it still has
    assert routed.held([1, 2, 3, 4], ["d"], reached=True) == {"d": 2 * BLOCK_SIZE}
    assert len(routed) == 4
