"""The index: which engines hold which blocks, keyed by a chain over token ids.

vLLM's own block hashes start from a seed that is random per process for its fast hash
algorithms (and PYTHONHASHSEED or `--prefix-caching-hash-algo` change it), so a router cannot
recompute them. The index keys a block by its own chain instead: the key of its parent and its
token ids, which BlockStored carries. Per engine it maps the engine's hash to our key, because
BlockRemoved and a child's parent name engine hashes.

Compact on purpose: a key is one int, the engines holding it one int bitmask (a small int for up
to 8 engines, shared by Python), the per-engine maps plain dicts in storage order. The bound is
on (engine, block) entries; past it the oldest-stored entries of the largest engine go, a batch
at a time (a dict evicts from its front cheaply only in batches). vLLM announces a block again
with BlockStored when a request reuses it, so storage order is also use order.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from extproc.kvcache.events import AllCleared, BlocksRemoved, BlocksStored, KvEvent

__all__ = ["KvIndex", "chain_keys"]

_KEY_MASK = (1 << 60) - 1  # below 2**60 a Python int is 32 bytes, above it 36
_ROOT = 0  # the parent key of a prompt's first block
_EVICT_FRACTION = 64  # evict 1/64 of the bound at once
_INT_BYTES = 32
# The chain is a keyed hash with a key of this process's own: a client who cannot learn it
# cannot craft a prompt whose blocks collide with another's (a faked cache hit).
_KEYED = hashlib.blake2b(digest_size=8, key=os.urandom(16))  # copied per block (cheaper)
_TOKEN = "I"  # token ids as 4-byte unsigned ints (vocabularies stay far below 2**32)
_TOKEN_BYTES = 4


def chain_keys(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Our key of each full block of `token_ids` (at most `limit` blocks)."""
    return list(itertools.islice(_chain(_ROOT, token_ids, block_size), limit))


def _chain(parent: int, token_ids: Sequence[int], block_size: int) -> Iterator[int]:
    """The keys of the full blocks of `token_ids` after `parent`, lazily (a lookup stops at
    the first block no engine holds). Ids that are no token (negative, over 2**32) give none."""
    try:
        data = array(_TOKEN, token_ids).tobytes()
    except (OverflowError, TypeError):
        return
    step = block_size * _TOKEN_BYTES
    digest = parent.to_bytes(8, "little")
    for start in range(0, len(data) // step * step, step):
        hasher = _KEYED.copy()
        hasher.update(digest + data[start : start + step])
        key = int.from_bytes(hasher.digest(), "little") & _KEY_MASK
        digest = key.to_bytes(8, "little")
        yield key


@dataclass(slots=True)
class _Engine:
    slot: int  # its bit in the masks
    block_size: int = 0  # learned from its events; 0 until the first BlockStored
    blocks: dict[int, int] | None = None  # engine hash -> our key, oldest stored first

    def held(self) -> dict[int, int]:
        if self.blocks is None:
            self.blocks = {}
        return self.blocks


class KvIndex:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._holders: dict[int, int] = {}  # our key -> bitmask of the engines holding it
        self._engines: dict[str, _Engine] = {}
        self._free_slots: list[int] = []
        self._entries = 0
        self.orphans = 0  # stored blocks whose parent the index does not know: not indexed
        self.evicted = 0

    # -- engines -------------------------------------------------------------------------------

    def add_engine(self, engine: str) -> None:
        if engine not in self._engines:
            slot = self._free_slots.pop() if self._free_slots else len(self._engines)
            self._engines[engine] = _Engine(slot)

    def remove_engine(self, engine: str) -> None:
        if engine in self._engines:
            self.clear_engine(engine)
            self._free_slots.append(self._engines.pop(engine).slot)

    def clear_engine(self, engine: str) -> None:
        state = self._engines.get(engine)
        if state is not None and state.blocks:
            self._drop(state, list(state.blocks))

    def engines(self) -> list[str]:
        return list(self._engines)

    # -- events --------------------------------------------------------------------------------

    def apply(self, engine: str, events: Iterable[KvEvent]) -> None:
        self.add_engine(engine)
        state = self._engines[engine]
        for event in events:
            if isinstance(event, BlocksStored):
                self._store(state, event)
            elif isinstance(event, BlocksRemoved):
                self._drop(state, event.engine_hashes)
            elif isinstance(event, AllCleared):
                self.clear_engine(engine)
        if self._entries > self.max_blocks:
            self._evict()

    def _store(self, state: _Engine, event: BlocksStored) -> None:
        held = state.held()
        if event.parent_engine_hash is None:
            parent: int | None = _ROOT
        else:
            parent = held.get(event.parent_engine_hash)
        if parent is None or not event.plain:
            self.orphans += len(event.engine_hashes)
            return
        state.block_size = event.block_size
        bit = 1 << state.slot
        keys = _chain(parent, event.token_ids, event.block_size)
        for engine_hash, key in zip(event.engine_hashes, keys, strict=False):
            old = held.pop(engine_hash, None)
            if old is None:
                self._entries += 1
            elif old != key:
                self._unhold(old, bit)
            held[engine_hash] = key  # (re)inserted last: the most recently stored
            self._holders[key] = self._holders.get(key, 0) | bit

    def _drop(self, state: _Engine, engine_hashes: Iterable[int]) -> None:
        held = state.held()
        bit = 1 << state.slot
        for engine_hash in engine_hashes:
            key = held.pop(engine_hash, None)
            if key is not None:
                self._entries -= 1
                self._unhold(key, bit)

    def _unhold(self, key: int, bit: int) -> None:
        mask = self._holders.get(key, 0) & ~bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def _evict(self) -> None:
        batch = max(1, self.max_blocks // _EVICT_FRACTION)
        while self._entries > self.max_blocks:
            largest = max(self._engines.values(), key=lambda e: len(e.blocks or ()))
            held = largest.held()
            oldest = list(itertools.islice(held, min(batch, len(held))))
            self.evicted += len(oldest)
            self._drop(largest, oldest)

    # -- lookups -------------------------------------------------------------------------------

    def longest_prefix(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Per engine, how many leading full blocks of `token_ids` it holds."""
        by_size: dict[int, list[_Engine]] = {}
        for state in self._engines.values():
            if state.block_size:
                by_size.setdefault(state.block_size, []).append(state)
        found = dict.fromkeys(self._engines, 0)
        names = {state.slot: name for name, state in self._engines.items()}
        for size, states in by_size.items():
            for slot, blocks in self._walk(token_ids, size, [s.slot for s in states]).items():
                found[names[slot]] = blocks
        return found

    def cached_tokens(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Per engine whose events have told its block size, how many leading tokens of
        `token_ids` it holds (full blocks × block size). Engines not yet heard from are left
        out: what they hold is unknown, not nothing."""
        sizes = {name: state.block_size for name, state in self._engines.items()
                 if state.block_size}  # fmt: skip
        if not sizes:
            return {}
        return {name: blocks * sizes[name] for name, blocks in
                self.longest_prefix(token_ids).items() if name in sizes}  # fmt: skip

    def _walk(self, token_ids: Sequence[int], size: int, slots: list[int]) -> dict[int, int]:
        alive = sum(1 << slot for slot in slots)
        reached = dict.fromkeys(slots, 0)
        holders, depth = self._holders, 0
        for key in _chain(_ROOT, token_ids, size):
            still = alive & holders.get(key, 0)
            if still != alive:
                _settle(reached, alive & ~still, depth)
                alive = still
                if not alive:
                    break
            depth += 1
        _settle(reached, alive, depth)
        return reached

    # -- size ----------------------------------------------------------------------------------

    @property
    def blocks(self) -> int:
        """(engine, block) entries held: what `max_blocks` bounds."""
        return self._entries

    @property
    def distinct_blocks(self) -> int:
        return len(self._holders)

    def bytes_estimate(self) -> int:
        """The index's memory without walking it: the dicts' own tables, an int per engine
        hash and one per key (masks of up to 8 engines are Python's shared small ints)."""
        tables = sys.getsizeof(self._holders) + sum(
            sys.getsizeof(e.blocks) for e in self._engines.values() if e.blocks is not None
        )
        return tables + _INT_BYTES * (self._entries + len(self._holders))


def _settle(reached: dict[int, int], mask: int, depth: int) -> None:
    for slot in reached:
        if mask >> slot & 1:
            reached[slot] = depth
