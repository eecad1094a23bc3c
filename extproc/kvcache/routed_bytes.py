"""What this sidecar sent where, by the prompt's raw bytes: cache awareness that needs neither
the engines' KV events nor the model's tokenizer.

A prompt's raw JSON bytes (a completion's `prompt`, a chat's `messages`) are cut into blocks of
`block_bytes` and each block is keyed as the index keys token blocks, by everything before it:
a keyed hash of the request's cache scope (its LoRA adapter and cache salt), of whatever else
reaches the prompt ahead of the messages (a chat's `tools`) and of the prompt's bytes up to the
block's end (one running hash, read once). Two prompts share a block's key only if they share
every byte up to its end in the same scope, so the leading blocks a prompt has in common with
one routed before are the leading bytes they share, to a block. A client serialises the turns
of a conversation the same way each time, so a next turn's `messages` start with the bytes of
the last one's.

Per block key, a bitmask of the engines this sidecar sent it to and, of them, those it has
reached (`land`: D's answer to the request passed, which for a P/D request follows P's, so
the KV is on D or on its way): a D sent a prompt through a P that still has it queued does
not hold it yet, and the decision must not budget D's stall on blocks D has to compute. The
map is in order of use (each prompt routed moves its blocks to the newest end, its first block
last, so that the deepest blocks of a chain go first, as an engine's LRU evicts them).
Bounds, whatever the input: at most `max_blocks` blocks are hashed per prompt (its first
`block_bytes × max_blocks` bytes; a longer prompt counts as sharing all of those) and at most
`max_entries` block keys are kept, the least recently routed going first in batches. An engine
that leaves the pool takes its bits out of every mask (once, in one pass over the entries) and
its bits are reused.

It is an estimate: evictions on the engine, restarts the sidecar does not see and other
routers' traffic are not seen, and a block routed to several engines is refreshed for all of
them whenever one of them is sent it again.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Collection, Sequence

from extproc.kvcache.scope import PLAIN, CacheScope

__all__ = ["BLOCK_BYTES", "MAX_BLOCKS", "MAX_ENTRIES", "RoutedBytes"]

BLOCK_BYTES = 128  # ~32 tokens of English JSON (two of vLLM's default blocks)
MAX_BLOCKS = 256  # a prompt's first 32 KiB (~8k tokens): the hashing a request may cost
MAX_ENTRIES = 131_072  # block keys kept: ~13 MiB (~100 bytes each), 16 MiB of prompts
_EVICT_FRACTION = 64  # evicted at once past the bound: 1/64 of it (no per-insert eviction)
_SENT, _LANDED = 0, 1  # an engine's two bits in a key's mask: 2 x its slot, plus one of these
# Keyed with a key of this process's own: a client who cannot learn it cannot craft a prompt
# whose blocks collide with another's.
_KEYED = hashlib.blake2b(digest_size=8, key=os.urandom(16))


class RoutedBytes:
    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        block_bytes: int = BLOCK_BYTES,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        self.max_entries = max_entries
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self._masks: dict[int, int] = {}  # block key → its engines' bits; least recent first
        self._slot: dict[str, int] = {}  # engine → its bit
        self._free: list[int] = []  # bits of engines forgotten, to reuse

    def keys(
        self, prompt: bytes | memoryview, scope: CacheScope = PLAIN, context: bytes = b""
    ) -> list[int]:
        """The keys of the full blocks of `prompt` (at most `max_blocks`) in `scope`, after
        `context` (what reaches the prompt before it)."""
        hasher, step = _KEYED.copy(), self.block_bytes
        for part in (scope.adapter, scope.salt):
            data = b"\x00" if part is None else b"\x01" + part.encode("utf-8", "surrogatepass")
            hasher.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: unambiguous
        hasher.update(len(context).to_bytes(8, "little"))
        hasher.update(context[: step * self.max_blocks])  # bounded as the prompt is
        end = min(len(prompt) // step, self.max_blocks) * step
        view = memoryview(prompt)
        keys = []
        for start in range(0, end, step):  # one running hash: each key covers all before it
            hasher.update(view[start : start + step])
            keys.append(int.from_bytes(hasher.copy().digest(), "little"))
        return keys

    def held(self, keys: Sequence[int], engines: Collection[str] | None = None) -> dict[str, int]:
        """Per engine (of `engines`; None: all) sent any of them: how many leading bytes of
        the prompt (whole blocks) this sidecar sent it."""
        return self._depths(keys, engines, _SENT)

    def landed(self, keys: Sequence[int], engines: Collection[str] | None = None) -> dict[str, int]:
        """As `held`, counting only the blocks that have reached the engine (`land`)."""
        return self._depths(keys, engines, _LANDED)

    def _depths(
        self, keys: Sequence[int], engines: Collection[str] | None, kind: int
    ) -> dict[str, int]:
        among = self._slot if engines is None else engines
        bits = {2 * slot + kind: e for e in among if (slot := self._slot.get(e)) is not None}
        alive = sum(1 << bit for bit in bits)
        found: dict[str, int] = {}
        depth = 0
        masks = self._masks
        for key in keys:
            still = masks.get(key, 0) & alive
            if still != alive:
                self._credit(found, bits, alive & ~still, depth)
                alive = still
                if not alive:
                    break
            depth += 1
        self._credit(found, bits, alive, depth)
        return found

    def _credit(self, found: dict[str, int], bits: dict[int, str], mask: int, depth: int) -> None:
        if not depth:
            return
        while mask:
            low = mask & -mask
            found[bits[low.bit_length() - 1]] = depth * self.block_bytes
            mask ^= low

    def remember(self, engines: Collection[str], keys: Sequence[int]) -> None:
        """`engines` were sent a prompt of these block keys."""
        if not keys:
            return
        bits = 0
        for engine in engines:
            bits |= 1 << 2 * self._slot_of(engine) + _SENT
        masks = self._masks
        for key in reversed(keys):  # the first block last: the newest, evicted last
            masks[key] = masks.pop(key, 0) | bits
        if len(masks) > self.max_entries:
            batch = max(len(masks) - self.max_entries, self.max_entries // _EVICT_FRACTION)
            for key in list(itertools.islice(masks, batch)):
                del masks[key]

    def land(self, engine: str, keys: Sequence[int]) -> None:
        """The prompt of these keys, sent to `engine`, is there now: its blocks count as
        reached (`landed`). Their place in the map (when they were sent) is kept."""
        slot = self._slot.get(engine)
        if slot is None:
            return
        sent, reached = 1 << 2 * slot + _SENT, 1 << 2 * slot + _LANDED
        masks = self._masks
        for key in keys:
            mask = masks.get(key, 0)
            if mask & sent:  # still kept, and sent there
                masks[key] = mask | reached

    def _slot_of(self, engine: str) -> int:
        slot = self._slot.get(engine)
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slot)
            self._slot[engine] = slot
        return slot

    def forget(self, engine: str) -> None:
        """What was sent to `engine` no longer counts (it left the pool, or restarted)."""
        slot = self._slot.pop(engine, None)
        if slot is None:
            return
        keep = ~(3 << 2 * slot)  # sent and reached
        masks = self._masks
        for key, mask in list(masks.items()):
            if mask >> 2 * slot & 3:
                if mask & keep:
                    masks[key] = mask & keep  # an existing key: its place is kept
                else:
                    del masks[key]
        self._free.append(slot)

    def engines(self) -> set[str]:
        return set(self._slot)

    def __len__(self) -> int:
        return len(self._masks)
