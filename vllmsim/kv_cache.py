"""KV block pool (blocks of `--block-size` tokens, each with its content and, once full and
cached, its prefix hash) and the P-side lease table.

The pool hands out block ids and keeps what each block holds (kv_content.py); a freed block
forgets its content unless the prefix cache keeps it. A lease keeps a finished prefill's
blocks alive for the decode side until the transfer finishes or `kv_lease_duration` passes.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllmsim.kv_content import BlockContent
from vllmsim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from vllmsim.prefix_cache import NO_SCOPE, HashScope, external_hash


class BlockPool:
    """Block ids, their content, and (with prefix caching) the full blocks' hashes.

    As in vLLM, a freed block that holds a hashed full block stays in the cache: it joins the
    tail of the free queue, so allocation evicts the least recently freed cached block first;
    a freed block without a hash goes to the head (reused first). A cache hit takes a block
    back out of the free queue. Stores and evictions are queued as KV events.
    """

    def __init__(self, total: int, caching: bool = False, block_size: int = 16) -> None:
        self.total = total
        self.caching = caching
        self.block_size = block_size
        # Block 0 is vLLM's null block, so real ids start at 1. Head = next to hand out.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, total + 1))
        self._refs: dict[int, int] = {}
        self._content: dict[int, BlockContent] = {}
        self._hash_of: dict[int, bytes] = {}
        self._blocks_of: dict[bytes, dict[int, None]] = {}  # one hash may sit in several blocks
        self.events: list[KVEvent] = []

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    @property
    def cached_blocks(self) -> int:
        return len(self._hash_of)

    def usage(self) -> float:
        return self.used / self.total if self.total else 0.0

    def lookup(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes` (at most `max_blocks`)."""
        hit: list[int] = []
        for block_hash in hashes[: max(0, max_blocks)] if self.caching else ():
            holders = self._blocks_of.get(block_hash)
            if not holders:
                break
            hit.append(next(iter(holders)))
        return hit

    def allocate(self, n: int, hit: Sequence[int] = ()) -> list[int] | None:
        """`hit` (cached blocks, shared) followed by `n` new blocks, or None if they do not
        fit. A new block taken from the cache loses its hash (a BlockRemoved event)."""
        idle_hits = sum(1 for b in hit if b in self._free)
        if n + idle_hits > len(self._free):
            return None
        for block_id in hit:
            self._free.pop(block_id, None)
            self._refs[block_id] = self._refs.get(block_id, 0) + 1
        new = [self._free.popitem(last=False)[0] for _ in range(n)]
        for block_id in new:
            self._evict(block_id)
            self._content.pop(block_id, None)  # a transfer may have written into a free block
            self._refs[block_id] = 1
        return [*hit, *new]

    def free(self, blocks: Sequence[int]) -> None:
        """Release one reference to each block; tail blocks are evicted first (vLLM frees a
        request's blocks in reverse order)."""
        to_head: list[int] = []
        for block_id in reversed(blocks):
            refs = self._refs.get(block_id, 0) - 1
            if refs > 0:
                self._refs[block_id] = refs
                continue
            self._refs.pop(block_id, None)
            if block_id in self._hash_of:
                self._free[block_id] = None  # the LRU tail
            else:
                to_head.append(block_id)
                self._content.pop(block_id, None)
        for block_id in reversed(to_head):
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def cache(
        self,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        start: int,
        token_ids: Sequence[int],
        session_id: str | None = None,
        scope: HashScope = NO_SCOPE,
    ) -> None:
        """Blocks [start, len(hashes)) became full: record their hashes, queue a BlockStored
        (tagged with the request's `session_id`, and with the adapter and each block's extra
        keys of its `scope`, as vLLM does)."""
        if not self.caching or start >= len(hashes):
            return
        for block_id, block_hash in zip(blocks[start:], hashes[start:], strict=False):
            self._hash_of[block_id] = block_hash
            self._blocks_of.setdefault(block_hash, {})[block_id] = None
        bs = self.block_size
        parent = external_hash(hashes[start - 1]) if start > 0 else None
        extra_keys = [scope.extra_keys(index) for index in range(start, len(hashes))]
        self.events.append(
            BlockStored(
                [external_hash(h) for h in hashes[start:]],
                parent,
                list(token_ids[start * bs : len(hashes) * bs]),
                bs,
                session_id,
                scope.lora_id,
                scope.lora_name,
                extra_keys if any(keys is not None for keys in extra_keys) else None,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's hash (an AllBlocksCleared event), as vLLM's
        BlockPool.reset_prefix_cache: only when no block is in use, else nothing (False)."""
        if self._refs:
            return False
        for block_id in self._hash_of:
            self._content.pop(block_id, None)
        self._hash_of.clear()
        self._blocks_of.clear()
        if self.caching:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is None:
            return
        holders = self._blocks_of.get(block_hash, {})
        holders.pop(block_id, None)
        if not holders:
            self._blocks_of.pop(block_hash, None)
        self.events.append(BlockRemoved([external_hash(block_hash)]))

    def write(self, block_ids: list[int], contents: list[BlockContent]) -> None:
        """Store contents by position; ids outside the pool are ignored."""
        for block_id, content in zip(block_ids, contents, strict=False):
            if 1 <= block_id <= self.total:
                self._content[block_id] = content

    def read(self, block_ids: list[int]) -> list[BlockContent | None]:
        """What the blocks hold; None for a block nothing wrote (or an id outside the pool)."""
        return [self._content.get(block_id) for block_id in block_ids]


@dataclass(eq=False)
class Lease:
    """Blocks of one finished P request, held for the decode side."""

    request_id: str
    blocks: list[int]
    num_tokens: int
    transfer_id: str | None
    finished_at: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None


class LeaseTable:
    """P-side leases keyed by P's internal request id; expiry frees the blocks.

    Blocks go back to the pool outside the engine's step (a transfer done, a lease expired), so
    every release calls `on_free`: requests waiting for blocks may fit now, and the engine must
    not wait for an unrelated arrival to admit them.
    """

    def __init__(
        self,
        pool: BlockPool,
        duration_s: float,
        on_expire: Callable[[Lease], None],
        on_free: Callable[[], None],
    ) -> None:
        self._pool = pool
        self._duration = duration_s
        self._on_expire = on_expire
        self._on_free = on_free
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def blocks_held(self) -> int:
        return sum(len(lease.blocks) for lease in self._leases.values())

    def add(self, lease: Lease) -> None:
        loop = asyncio.get_running_loop()
        lease.timer = loop.call_later(self._duration, self._expire, lease.request_id)
        self._leases[lease.request_id] = lease

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def release(self, request_id: str) -> Lease | None:
        """Transfer done: free the blocks now. Returns None if already gone."""
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            if lease.timer is not None:
                lease.timer.cancel()
            self._pool.free(lease.blocks)
            self._on_free()
        return lease

    def clear(self) -> None:
        for rid in list(self._leases):
            self.release(rid)

    def _expire(self, request_id: str) -> None:
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return
        self._pool.free(lease.blocks)
        self._on_free()
        self._on_expire(lease)
