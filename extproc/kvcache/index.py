"""The index: which engines hold which blocks, keyed by a chain over token ids.

vLLM's own block hashes start from a seed that is random per process for its fast hash
algorithms (and PYTHONHASHSEED or `--prefix-caching-hash-algo` change it), so a router cannot
recompute them. The index keys a block by its own chain instead: the key of its parent and its
token ids, which BlockStored carries. Per engine it maps the engine's hash to our key, because
BlockRemoved and a child's parent name engine hashes. Like vLLM's, the chain depends on the
block's cache scope (`extproc.kvcache.scope`): a cache salt starts it from a root of its own,
and a LoRA adapter's name goes into every block's key.

Compact on purpose (a million entries in about 40 MB): the maps are `IntMap`s, sorted arrays
of machine ints, not dicts of int objects. Our key -> a bitmask of the engines holding it; per
engine, its (mixed) hash -> our key and the chunk of its storage log that holds its newest
record. The log keeps an engine's hashes in storage order, in chunks; a record is stale once
its block is removed or stored again later. The bound is on (engine, block) entries; past it
the oldest-stored entries of the largest engine go, as many as are over, read off the log's
front (so eviction costs in step with the blocks stored, with no batch to stall on). vLLM
announces a block again with BlockStored when a request reuses it, so storage order is also
use order.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from extproc.kvcache.events import AllCleared, BlocksRemoved, BlocksStored, KvEvent
from extproc.kvcache.intmap import ARRAY_BYTES, KEY_BITS, IntMap, column_code
from extproc.kvcache.scope import PLAIN, CacheScope

__all__ = ["KvIndex", "chain_keys"]

_KEY_MASK = (1 << KEY_BITS) - 1
_ROOT = 0  # the parent key of an unsalted prompt's first block
_BASE_TAG = bytes(8)  # the adapter's part of a block's key, for the base model
# Records in a chunk of an engine's storage log: 1/64 of the bound, at most 1024. A block
# stored again while in the newest chunk keeps its place: the order's grain.
_CHUNK_FRACTION, _CHUNK_MAX = 64, 1024
_CHUNK_ID_MASK = (1 << 32) - 1  # chunk ids wrap at 2**32 (a 4-byte column)
# Engine hashes are mixed before they key a map, whose buckets are the keys' top bits:
# multiplying by an odd number modulo 2**60 is a bijection whose top bits depend on every bit.
_MIX = 0x9E3779B97F4A7C15 & _KEY_MASK
_LOG_CHUNK_BYTES = 56 + 8  # a chunk's (id, records) tuple and its slot in the list
# The chain is a keyed hash with a key of this process's own: a client who cannot learn it
# cannot craft a prompt whose blocks collide with another's (a faked cache hit).
_KEYED = hashlib.blake2b(digest_size=8, key=os.urandom(16))  # copied per block (cheaper)
_TOKEN = "I"  # token ids as 4-byte unsigned ints (vocabularies stay far below 2**32)
_TOKEN_BYTES = 4


def chain_keys(
    token_ids: Sequence[int], block_size: int, limit: int | None = None, scope: CacheScope = PLAIN
) -> list[int]:
    """Our key of each full block of `token_ids` (at most `limit` blocks) in `scope`."""
    chain = _chain(_root(scope.salt), token_ids, block_size, _adapter_tag(scope.adapter))
    return list(itertools.islice(chain, limit))


def _keyed(*parts: bytes) -> int:
    hasher = _KEYED.copy()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little") + part)  # length-prefixed: unambiguous
    return int.from_bytes(hasher.digest(), "little") & _KEY_MASK


def _root(salt: str | None) -> int:
    """The parent key of a prompt's first block: a salt's own root, as vLLM's first block
    hash covers the salt (and every later one, through the chain)."""
    return _ROOT if salt is None else _keyed(b"salt", salt.encode("utf-8", "surrogatepass"))


def _adapter_tag(adapter: str | None) -> bytes:
    """What every block's key covers of its LoRA adapter, as every vLLM block hash does."""
    if adapter is None:
        return _BASE_TAG
    return _keyed(b"lora", adapter.encode("utf-8", "surrogatepass")).to_bytes(8, "little")


def _chain(parent: int, token_ids: Sequence[int], block_size: int, tag: bytes) -> Iterator[int]:
    """The keys of the full blocks of `token_ids` after `parent` under adapter `tag`, lazily
    (a lookup stops at the first block no engine holds). Ids that are no token (negative,
    over 2**32) give none."""
    try:
        data = array(_TOKEN, token_ids).tobytes()
    except (OverflowError, TypeError):
        return
    step = block_size * _TOKEN_BYTES
    digest = parent.to_bytes(8, "little")
    tagged = _KEYED.copy()
    tagged.update(tag)  # fixed width: a block's input has one length per block size
    for start in range(0, len(data) // step * step, step):
        hasher = tagged.copy()
        hasher.update(digest + data[start : start + step])
        key = int.from_bytes(hasher.digest(), "little") & _KEY_MASK
        digest = key.to_bytes(8, "little")
        yield key


def _mixed(engine_hash: int) -> int:
    return (engine_hash * _MIX) & _KEY_MASK


def _held_map() -> IntMap:
    return IntMap("q", "I")  # mixed engine hash -> our key, and the chunk of its newest record


@dataclass(slots=True)
class _Engine:
    slot: int  # its bit in the masks
    epoch: int  # renewed whenever its entries are dropped (see KvIndex.epoch)
    block_size: int = 0  # learned from its events; 0 until the first BlockStored
    held: IntMap = field(default_factory=_held_map)
    # The storage log: (chunk id, mixed hashes in storage order), oldest chunk first; records
    # whose entry's chunk id is another (or that have no entry) are stale.
    chunks: list[tuple[int, array[int]]] = field(default_factory=list)
    records: int = 0  # in all chunks, stale ones included
    next_chunk: int = 0
    sweep: int = 0  # the chunk to compact next
    credit: int = 0  # records the compaction may still read: two per record logged

    def log(self, mixed: int, chunk_size: int) -> int:
        """Append a record; the id of the chunk it went to."""
        if not self.chunks or len(self.chunks[-1][1]) >= chunk_size:
            self.chunks.append((self.next_chunk, array("q")))
            self.next_chunk = (self.next_chunk + 1) & _CHUNK_ID_MASK
        chunk, records = self.chunks[-1]
        records.append(mixed)
        self.records += 1
        self.credit += 2
        return chunk

    def newest_chunk(self) -> int:
        return self.chunks[-1][0] if self.chunks else -1

    def live(self, mixed: int, chunk: int) -> tuple[int, int] | None:
        """Where the entry of a record of `chunk` is, if the record is its newest."""
        bucket, position, found = self.held.locate(mixed)
        if found and self.held.extras[bucket][position] == chunk:
            return bucket, position
        return None

    def compact(self, index: int, chunk_size: int) -> int:
        """Drop the stale records of one chunk, merging it into the one before where both fit
        in one chunk (so that chunks stay about half full); the records read."""
        chunk, records = self.chunks[index]
        kept = array("q")
        places = []
        for mixed in records:
            place = self.live(mixed, chunk)
            if place is not None:
                kept.append(mixed)
                places.append(place)
        if index and len(self.chunks[index - 1][1]) + len(kept) <= chunk_size:
            before, older = self.chunks[index - 1]
            chunk_ids = self.held.extras
            for bucket, position in places:
                chunk_ids[bucket][position] = before
            older.extend(kept)
            del self.chunks[index]
        elif not kept:
            del self.chunks[index]
        else:
            self.chunks[index] = (chunk, kept)
            self.sweep = index + 1
        self.records -= len(records) - len(kept)
        return len(records)

    def bytes_estimate(self) -> int:
        return (
            self.held.bytes_estimate()
            + int(self.records * 8 * (1 + 1 / 32))
            + len(self.chunks) * (_LOG_CHUNK_BYTES + ARRAY_BYTES)
        )


class KvIndex:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._chunk_size = max(1, min(max_blocks // _CHUNK_FRACTION, _CHUNK_MAX))
        self._holders = IntMap("B")  # our key -> bitmask of the engines holding it
        self._engines: dict[str, _Engine] = {}
        self._free_slots: list[int] = []
        self._entries = 0
        self.orphans = 0  # stored blocks whose parent the index does not know: not indexed
        self.evicted = 0
        self._epochs = itertools.count()

    # -- engines -------------------------------------------------------------------------------

    def add_engine(self, engine: str) -> None:
        if engine not in self._engines:
            slot = self._free_slots.pop() if self._free_slots else len(self._engines)
            self._engines[engine] = _Engine(slot, next(self._epochs))
            self._holders.widen(column_code(max(s.slot for s in self._engines.values()) + 1))

    def remove_engine(self, engine: str) -> None:
        if engine in self._engines:
            self.clear_engine(engine)
            self._free_slots.append(self._engines.pop(engine).slot)

    def clear_engine(self, engine: str) -> None:
        state = self._engines.get(engine)
        if state is None:
            return
        state.epoch = next(self._epochs)
        if not state.held.size:
            return
        bit = 1 << state.slot
        if state.held.size * 8 < self._holders.size:  # a few: one at a time
            for keys in state.held.values:
                for key in keys:
                    self._unhold(key, bit)
        else:
            self._holders.clear_bits(bit)
        self._entries -= state.held.size
        state.held, state.chunks, state.records, state.sweep = _held_map(), [], 0, 0

    def epoch(self, engine: str) -> int:
        """Changes whenever the engine's entries are dropped (cleared, or the engine removed):
        a batch applied in slices stops where its engine was reset between two of them, as if
        the reset had come after it. -1 for an engine not in the index."""
        state = self._engines.get(engine)
        return -1 if state is None else state.epoch

    def engines(self) -> list[str]:
        return list(self._engines)

    def heard_from(self, engine: str) -> bool:
        """The engine's events have told what it holds (its block size is known)."""
        state = self._engines.get(engine)
        return state is not None and state.block_size > 0

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
        if event.parent_engine_hash is None:
            parent: int | None = _root(event.cache_salt)
        else:
            parent = state.held.get(_mixed(event.parent_engine_hash))
        if parent is None or not event.plain:
            self.orphans += len(event.engine_hashes)
            return
        state.block_size = event.block_size
        bit = 1 << state.slot
        keys = _chain(parent, event.token_ids, event.block_size, _adapter_tag(event.lora_name))
        for engine_hash, key in zip(event.engine_hashes, keys, strict=False):
            self._put(state, (engine_hash * _MIX) & _KEY_MASK, key, bit)  # _mixed, inlined
        self._tidy(state)

    def _put(self, state: _Engine, mixed: int, key: int, bit: int) -> None:
        held = state.held
        bucket = mixed >> held.shift  # held.locate, inlined: one call a block stored
        hashes = held.keys[bucket]
        position = bisect_left(hashes, mixed)
        if position == len(hashes) or hashes[position] != mixed:
            held.insert(bucket, position, mixed, key, state.log(mixed, self._chunk_size))
            self._entries += 1
            self._hold(key, bit)
            return
        ours = held.values[bucket]
        if ours[position] != key:  # the engine reused its hash for other tokens
            self._unhold(ours[position], bit)
            ours[position] = key
            self._hold(key, bit)
        chunks = held.extras[bucket]
        if chunks[position] != state.newest_chunk():
            # Stored again: a new record at the end of the log, the old one goes stale. One
            # already in the newest chunk stays where it is (its order is off by < a chunk).
            chunks[position] = state.log(mixed, self._chunk_size)

    def _tidy(self, state: _Engine) -> None:
        """Keep an engine's log within about twice its entries: its chunks are compacted in
        turn, reading at most two records per record logged (so a flood of blocks stored again
        costs a constant share more, and no call reads more than a few chunks)."""
        limit = 2 * state.held.size + 4 * self._chunk_size
        if state.records <= limit:
            state.credit = 0
            return
        state.credit = min(state.credit, 8 * self._chunk_size)
        while state.records > limit and state.credit > 0 and len(state.chunks) > 1:
            if state.sweep >= len(state.chunks) - 1:  # the newest chunk is still filling
                state.sweep = 0
            state.credit -= state.compact(state.sweep, self._chunk_size)

    def _drop(self, state: _Engine, engine_hashes: Iterable[int]) -> None:
        held, bit = state.held, 1 << state.slot
        for engine_hash in engine_hashes:
            bucket, position, found = held.locate(_mixed(engine_hash))
            if found:
                key = held.values[bucket][position]
                held.delete(bucket, position)  # its record goes stale
                self._entries -= 1
                self._unhold(key, bit)

    def _hold(self, key: int, bit: int) -> None:
        holders = self._holders
        bucket = key >> holders.shift  # holders.locate, inlined
        keys = holders.keys[bucket]
        position = bisect_left(keys, key)
        if position < len(keys) and keys[position] == key:
            holders.values[bucket][position] |= bit
        else:
            holders.insert(bucket, position, key, bit)

    def _unhold(self, key: int, bit: int) -> None:
        holders = self._holders
        bucket, position, found = holders.locate(key)
        if found:
            masks = holders.values[bucket]
            if masks[position] & ~bit:
                masks[position] &= ~bit
            else:
                holders.delete(bucket, position)

    def _evict(self) -> None:
        while self._entries > self.max_blocks:
            largest = max(self._engines.values(), key=lambda e: e.held.size)
            self._evict_oldest(largest, min(self._entries - self.max_blocks, largest.held.size))

    def _evict_oldest(self, state: _Engine, count: int) -> None:
        """Drop the engine's `count` oldest-stored entries, read off the front of its log."""
        held, bit, evicted = state.held, 1 << state.slot, 0
        while evicted < count and state.chunks:
            chunk, records = state.chunks[0]
            read = 0
            for mixed in records:
                read += 1
                place = state.live(mixed, chunk)
                if place is not None:
                    key = held.values[place[0]][place[1]]
                    held.delete(*place)
                    self._entries -= 1
                    self._unhold(key, bit)
                    evicted += 1
                    if evicted == count:
                        break
            if read == len(records):
                del state.chunks[0]
                state.sweep = max(0, state.sweep - 1)
            else:
                del records[:read]
            state.records -= read
        self.evicted += evicted

    # -- lookups -------------------------------------------------------------------------------

    def longest_prefix(self, token_ids: Sequence[int], scope: CacheScope = PLAIN) -> dict[str, int]:
        """Per engine, how many leading full blocks of `token_ids` it holds in `scope`."""
        by_size: dict[int, list[_Engine]] = {}
        for state in self._engines.values():
            if state.block_size:
                by_size.setdefault(state.block_size, []).append(state)
        found = dict.fromkeys(self._engines, 0)
        names = {state.slot: name for name, state in self._engines.items()}
        for size, states in by_size.items():
            slots = [s.slot for s in states]
            for slot, blocks in self._walk(token_ids, size, slots, scope).items():
                found[names[slot]] = blocks
        return found

    def cached_tokens(self, token_ids: Sequence[int], scope: CacheScope = PLAIN) -> dict[str, int]:
        """Per engine whose events have told its block size, how many leading tokens of
        `token_ids` it holds (full blocks × block size) in `scope`. Engines not yet heard from
        are left out: what they hold is unknown, not nothing."""
        sizes = {
            name: state.block_size for name, state in self._engines.items() if state.block_size
        }
        if not sizes:
            return {}
        return {
            name: blocks * sizes[name]
            for name, blocks in self.longest_prefix(token_ids, scope).items()
            if name in sizes
        }

    def _walk(
        self, token_ids: Sequence[int], size: int, slots: list[int], scope: CacheScope
    ) -> dict[int, int]:
        alive = sum(1 << slot for slot in slots)
        reached = dict.fromkeys(slots, 0)
        holders, depth = self._holders, 0
        buckets, masks, shift = holders.keys, holders.values, holders.shift
        for key in _chain(_root(scope.salt), token_ids, size, _adapter_tag(scope.adapter)):
            bucket = key >> shift  # holders.get, inlined: this is the per-request path
            keys = buckets[bucket]
            position = bisect_left(keys, key)
            held = position < len(keys) and keys[position] == key
            still = alive & masks[bucket][position] if held else 0
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
        return self._holders.size

    def bytes_estimate(self) -> int:
        """The index's memory without walking it: its maps' arrays and the engines' logs."""
        return self._holders.bytes_estimate() + sum(
            state.bytes_estimate() for state in self._engines.values()
        )


def _settle(reached: dict[int, int], mask: int, depth: int) -> None:
    for slot in reached:
        if mask >> slot & 1:
            reached[slot] = depth
