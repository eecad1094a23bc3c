"""A batch's events cut into slices of bounded work, so that applying a batch of any size lets
the event loop run between slices.

Work is counted in blocks: a BlockStored's or BlockRemoved's hashes, and 1 for any other event
(or one skipped). An event larger than a slice is cut: a later piece of a BlockStored names the
last block of the piece before as its parent, as the engine's next BlockStored would, so the
index chains the pieces exactly as it chains the whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

from extproc.kvcache.events import BlocksRemoved, BlocksStored, KvEvent

__all__ = ["slices"]


def slices(events: Iterable[KvEvent | None], max_blocks: int) -> Iterator[list[KvEvent]]:
    """`events` (None: one skipped) in slices of about `max_blocks` blocks of work (at most
    twice that), read lazily: the caller decodes no further than the slice it applies."""
    piece: list[KvEvent] = []
    work = 0
    for event in events:
        for part in (None,) if event is None else _cut(event, max_blocks):
            if part is not None:
                piece.append(part)
            work += _blocks(part)
            if work >= max_blocks:
                yield piece
                piece, work = [], 0
    if work:
        yield piece


def _blocks(event: KvEvent | None) -> int:
    if isinstance(event, BlocksStored | BlocksRemoved):
        return len(event.engine_hashes)
    return 1


def _cut(event: KvEvent, max_blocks: int) -> Iterator[KvEvent]:
    if _blocks(event) <= max_blocks:
        yield event
    elif isinstance(event, BlocksRemoved):
        hashes = event.engine_hashes
        for start in range(0, len(hashes), max_blocks):
            yield BlocksRemoved(hashes[start : start + max_blocks])
    elif isinstance(event, BlocksStored):
        hashes, size = event.engine_hashes, event.block_size
        for start in range(0, len(hashes), max_blocks):
            end = start + max_blocks
            yield replace(
                event,
                engine_hashes=hashes[start:end],
                parent_engine_hash=hashes[start - 1] if start else event.parent_engine_hash,
                token_ids=event.token_ids[start * size : end * size],
            )
