"""KV block pool (16-token blocks, each with its content) and the P-side lease table.

The pool hands out block ids and keeps what each allocated block holds (kv_content.py); a
freed block forgets its content. A lease keeps a finished prefill's blocks alive for the
decode side until the transfer finishes or `kv_lease_duration` passes.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from vllmsim.kv_content import BlockContent


class BlockPool:
    def __init__(self, total: int) -> None:
        self.total = total
        # Block 0 is vLLM's null block, so real ids start at 1.
        self._free: deque[int] = deque(range(1, total + 1))
        self._content: dict[int, BlockContent] = {}

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def usage(self) -> float:
        return self.used / self.total if self.total else 0.0

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        self._forget(blocks)  # a transfer may have written into a block nobody held
        return blocks

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
        self._forget(blocks)

    def write(self, block_ids: list[int], contents: list[BlockContent]) -> None:
        """Store contents by position; ids outside the pool are ignored."""
        for block_id, content in zip(block_ids, contents, strict=False):
            if 1 <= block_id <= self.total:
                self._content[block_id] = content

    def read(self, block_ids: list[int]) -> list[BlockContent | None]:
        """What the blocks hold; None for a block nothing wrote (or an id outside the pool)."""
        return [self._content.get(block_id) for block_id in block_ids]

    def _forget(self, blocks: list[int]) -> None:
        for block_id in blocks:
            self._content.pop(block_id, None)


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
    """P-side leases keyed by P's internal request id; expiry frees the blocks."""

    def __init__(
        self, pool: BlockPool, duration_s: float, on_expire: Callable[[Lease], None]
    ) -> None:
        self._pool = pool
        self._duration = duration_s
        self._on_expire = on_expire
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
        return lease

    def clear(self) -> None:
        for rid in list(self._leases):
            self.release(rid)

    def _expire(self, request_id: str) -> None:
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return
        self._pool.free(lease.blocks)
        self._on_expire(lease)
