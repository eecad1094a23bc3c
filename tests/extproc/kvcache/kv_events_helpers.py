"""KV event batches written as vLLM's msgspec encoder writes them (maps tagged by `type`), for
the kvcache tests."""

from __future__ import annotations

from typing import Any

import msgpack

BLOCK = 4


def stored(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
            "lora_name": None, **extra}


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def batch(*events: Any, ts: float = 1.0) -> bytes:
    return msgpack.packb([ts, list(events), 0])


def chain(first_hash: int, tokens: list[int], parent: Any = None) -> dict[str, Any]:
    """One BlockStored of consecutive blocks hashed first_hash, first_hash + 1, ..."""
    n = len(tokens) // BLOCK
    return stored(list(range(first_hash, first_hash + n)), parent, tokens)
