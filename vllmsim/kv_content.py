"""What a KV block holds, where it came from, and what a decode reads from it.

A local prefill fills a request's prompt blocks with a chained fingerprint: each block's
hash covers the token ids of that block and the previous block's fingerprint, like a
prefix-cache hash. A transfer copies the fingerprints into another engine's blocks. A
decode derives its output from the fingerprints its blocks hold, so KV written into the
wrong blocks, cut short, or computed for another prompt changes the answer, as it would
with real KV; correct KV gives exactly the answer of a local prefill.

Each block also keeps its provenance (computed here, or written by which transfer from
which engine): the label of how a decode got its KV is read from that evidence.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllmsim.config import BLOCK_SIZE

LOCAL = "local"  # the origin of a block this engine computed itself
EMPTY = "empty"  # what the evidence says about a prompt block nothing wrote
PARTIAL = "partial"  # the label when the prompt blocks did not all come from one place
_FINGERPRINT_BYTES = 16


@dataclass(frozen=True, slots=True)
class BlockContent:
    fingerprint: bytes
    origin: str  # LOCAL, or the transfer that wrote it: pull | push-parallel | push-serial
    engine_id: str  # the engine whose prefill computed the fingerprint


def fingerprints(token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """The chained fingerprint of every (full or partial) block of a prompt."""
    raw, step = _token_bytes(token_ids), block_size * 8
    chain: list[bytes] = []
    previous = b""
    for start in range(0, len(raw), step):
        previous = _fingerprint(previous, raw[start : start + step])
        chain.append(previous)
    return chain


def block_fingerprint(index: int, before: BlockContent | None, token_ids: Sequence[int]) -> bytes:
    """The fingerprint of block `index` computed after `before` (what the block before it
    holds; an unwritten one reads as zeros): a block that decoding filled gets what a prefill
    of the same tokens gives it."""
    previous = b"" if index == 0 else (before.fingerprint if before else bytes(_FINGERPRINT_BYTES))
    return _fingerprint(previous, _token_bytes(token_ids))


def _fingerprint(previous: bytes, block: bytes) -> bytes:
    return hashlib.blake2b(previous + block, digest_size=_FINGERPRINT_BYTES).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """8 bytes per token id (a C array: much cheaper than formatting the ids as text)."""
    try:
        return array("q", token_ids).tobytes()
    except OverflowError:  # ids beyond 64 bits, from a token-id prompt: wrap them (same bytes)
        return array("Q", [t % 2**64 for t in token_ids]).tobytes()


def num_prompt_blocks(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


def context_seed(held: Sequence[BlockContent | None]) -> bytes:
    """What a decode reads: every prompt block's fingerprint in order; an unwritten block
    reads as zeros."""
    digest = hashlib.blake2b(digest_size=_FINGERPRINT_BYTES)
    for block in held:
        digest.update(block.fingerprint if block is not None else bytes(_FINGERPRINT_BYTES))
    return digest.digest()


@dataclass(frozen=True)
class Evidence:
    """Where the prompt blocks a decode read came from."""

    origins: Counter[str]  # prompt blocks per origin (EMPTY: nothing wrote them)
    engine_ids: tuple[str, ...]  # engines whose prefill the blocks hold, in block order

    @classmethod
    def of(cls, held: Sequence[BlockContent | None]) -> Evidence:
        origins = Counter(block.origin if block is not None else EMPTY for block in held)
        engines = dict.fromkeys(block.engine_id for block in held if block is not None)
        return cls(origins, tuple(engines))

    def label(self, computed_here: str) -> str:
        """`computed_here` names a prompt computed by this engine (local, prefill, recompute);
        a transfer's label names KV that one transfer wrote; anything else is partial."""
        if not self.origins or set(self.origins) == {LOCAL}:
            return computed_here
        if len(self.origins) == 1 and EMPTY not in self.origins:
            return next(iter(self.origins))
        return PARTIAL

    def as_dict(self) -> dict[str, Any]:
        return {"blocks": dict(self.origins), "engine_ids": list(self.engine_ids)}


# -- on the wire: a transfer carries fingerprints; the receiver records who sent them --------
def to_wire(held: Sequence[BlockContent | None]) -> list[bytes | None]:
    return [block.fingerprint if block is not None else None for block in held]


def from_wire(blocks: Any, origin: str, engine_id: str) -> list[BlockContent]:
    """Fingerprints as received. A source block nobody wrote (or anything malformed) still
    overwrites the target block: with zeros, as a copy of unwritten memory would."""
    if not isinstance(blocks, list):
        return []
    zeros = bytes(_FINGERPRINT_BYTES)
    return [
        BlockContent(fp if isinstance(fp, bytes) else zeros, origin, engine_id) for fp in blocks
    ]
