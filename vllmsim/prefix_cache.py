"""Prefix-cache block hashes, computed as vLLM's default (`sha256`) does.

A full block's hash covers its parent's hash, its token ids and its extra keys: as vLLM's,
the LoRA adapter's name on every block of an adapter's request, then the request's
`cache_salt` on its first block only (every later block differs too, through the chain); None
for a block with neither (no multimodal input here). The first block's parent is a fixed seed
hash, so two processes hash the same prompt the same way. Only full blocks are hashed.
KV events carry the hash as vLLM publishes it by default: the low 64 bits as an integer, and
each block's extra keys.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

_SEED = "vllm-none-hash"  # vLLM's fixed seed for cryptographic hashes
_PICKLE_PROTOCOL = 5  # what vLLM's pickling uses on Python 3.11+ (the highest)


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def root_hash() -> bytes:
    """The parent of every prompt's first block (PYTHONHASHSEED overrides the seed)."""
    return _sha256(os.environ.get("PYTHONHASHSEED", _SEED))


@dataclass(frozen=True)
class HashScope:
    """What of a request besides its tokens its blocks' hashes cover."""

    lora_name: str | None = None  # the LoRA adapter the request names (its model)
    lora_id: int | None = None  # the adapter's id (KV events carry it, deprecated in vLLM)
    cache_salt: str | None = None

    def extra_keys(self, block_index: int) -> tuple[str, ...] | None:
        """Block `block_index`'s extra keys, in vLLM's order (adapter, then salt)."""
        keys = [self.lora_name] if self.lora_name else []
        if block_index == 0 and self.cache_salt:
            keys.append(self.cache_salt)
        return tuple(keys) or None


NO_SCOPE = HashScope()


def block_hashes(
    token_ids: Sequence[int], block_size: int, scope: HashScope = NO_SCOPE
) -> list[bytes]:
    """The chained hash of every full block of `token_ids`."""
    chain: list[bytes] = []
    extend_hashes(chain, token_ids, block_size, scope)
    return chain


def extend_hashes(
    chain: list[bytes], token_ids: Sequence[int], block_size: int, scope: HashScope = NO_SCOPE
) -> None:
    """Append the hashes of the full blocks of `token_ids` that `chain` does not cover yet."""
    parent = chain[-1] if chain else root_hash()
    for start in range(len(chain) * block_size, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        parent = _sha256((parent, block, scope.extra_keys(start // block_size)))
        chain.append(parent)


def external_hash(block_hash: bytes) -> int:
    """A block hash as KV events carry it (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
