"""vLLM's KV event batches, decoded from the bytes its ZMQ publisher sends.

A batch is a msgpack array `[ts, events, data_parallel_rank?]`; each event is a tagged struct,
written by vLLM as a map with a `type` field (or, by older releases, as an array whose first item
is the tag). Only what the index needs is kept; unknown tags and extra fields are ignored, and a
payload that is not a batch raises `MalformedBatch`, which the subscriber counts and skips.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "AllCleared",
    "BlocksRemoved",
    "BlocksStored",
    "EventBatch",
    "KvEvent",
    "MalformedBatch",
    "decode_batch",
    "engine_hash",
    "read_batch",
]

# Bounds on one payload, far above what an engine sends (a batch is one scheduler step).
MAX_EVENTS_PER_BATCH = 65_536
# The longest array: token ids of one BlockStored, which one request fills in one engine step
# (at most the engine's max_num_batched_tokens). Decoding one event cannot be cut, so this also
# bounds how long one holds the event loop (a 2**18-token event: about 30 ms).
_MAX_ARRAY = 1 << 18
# No bound of its own on strings: vLLM copies a client's `session_id` (any length) into the
# BlockStored events of its request, and a batch refused for it would lose the other requests'
# events of that engine step. A string is never longer than its payload, which the subscriber
# bounds (ZMQ_MAXMSGSIZE).
_MAX_BIN = 1024  # a block hash is 32 bytes
_MAX_MAP = 64
_HASH_MASK = (1 << 60) - 1  # of vLLM's 64: below 2**60 a Python int is 32 bytes, above it 36
_INDEXED_MEDIA = (None, "GPU")  # blocks an engine can prefix-hit at once; CPU/storage tiers are not


class MalformedBatch(ValueError):
    """A payload that is not a KV event batch; `reason` names what was wrong, for a metric label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive full blocks of one request, each `block_size` tokens of `token_ids`."""

    engine_hashes: tuple[int, ...]
    parent_engine_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    # Keyed by tokens, LoRA adapter and cache salt alone: no multimodal input, prompt embeds,
    # unnamed adapter or secondary group (such blocks are not indexed).
    plain: bool
    lora_name: str | None = None  # the adapter of every block (vLLM keys each by it)
    cache_salt: str | None = None  # in the first block's extra keys (a block with no parent)


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    engine_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KvEvent, ...]
    skipped: int  # events of unknown tags or of media the index does not keep


def engine_hash(value: object) -> int:
    """An engine's block hash as an int of 60 bits: vLLM sends 32 bytes or (with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) their low 64 bits, and both give the same int here."""
    if isinstance(value, bytes):
        if not value:
            raise MalformedBatch("empty_hash")
        return int.from_bytes(value, "big") & _HASH_MASK
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _HASH_MASK
    raise MalformedBatch("hash_type")


def decode_batch(payload: bytes) -> EventBatch:
    ts, items, read = read_batch(payload)
    events = [event for event in read if event is not None]
    return EventBatch(ts, tuple(events), items - len(events))


def read_batch(payload: bytes) -> tuple[float, int, Iterator[KvEvent | None]]:
    """The batch's timestamp, its number of events, and its events decoded one at a time (None
    for one skipped), so that a caller can yield between them. `MalformedBatch` comes at once
    for a payload that is no batch, or from the iterator at the event that is wrong."""
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        max_buffer_size=max(1, len(payload)),
        max_array_len=_MAX_ARRAY,
        max_map_len=_MAX_MAP,
        max_str_len=len(payload),
        max_bin_len=_MAX_BIN,
        max_ext_len=0,
    )
    unpacker.feed(payload)
    fields = _array_header(unpacker, payload)
    with _as_malformed():
        ts = unpacker.unpack() if fields >= 2 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedBatch("not_a_batch")
    items = _array_header(unpacker, payload)
    if items > MAX_EVENTS_PER_BATCH:
        raise MalformedBatch("too_many_events")
    return float(ts), items, _events(unpacker, items, fields - 2, len(payload))


def _events(
    unpacker: msgpack.Unpacker, items: int, rest: int, size: int
) -> Iterator[KvEvent | None]:
    for _ in range(items):
        with _as_malformed():
            item = unpacker.unpack()
        yield _decode_event(item)
    with _as_malformed():
        for _ in range(rest):  # the data-parallel rank, and what later releases may add
            unpacker.skip()
    if unpacker.tell() != size:
        raise MalformedBatch("msgpack")  # bytes after the batch


def _array_header(unpacker: msgpack.Unpacker, payload: bytes) -> int:
    at = unpacker.tell()
    try:
        return int(unpacker.read_array_header())
    except (ValueError, msgpack.UnpackException) as exc:
        # msgpack that is not an array, or no msgpack at all (cut short, or 0xc1: never used)
        broken = payload[at : at + 1] in (b"", b"\xc1")
        raise MalformedBatch("msgpack" if broken else "not_a_batch") from exc


@contextmanager
def _as_malformed() -> Iterator[None]:
    try:
        yield
    except MalformedBatch:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # OutOfData, ExtraData...
        raise MalformedBatch("msgpack") from exc


def _decode_event(item: object) -> KvEvent | None:
    if isinstance(item, dict):
        fields: dict[str, Any] = item
        tag = fields.get("type")
    elif isinstance(item, list) and item and isinstance(item[0], str):
        tag = item[0]
        fields = dict(zip(_ARRAY_FIELDS.get(tag, ()), item[1:], strict=False))
    else:
        raise MalformedBatch("event_shape")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        if fields.get("medium") not in _INDEXED_MEDIA or fields.get("group_idx") not in (None, 0):
            return None
        return BlocksRemoved(_hashes(fields.get("block_hashes")))
    if tag == "AllBlocksCleared":
        return AllCleared()
    return None  # a tag this version does not know: skipped, not an error


def _stored(fields: dict[str, Any]) -> BlocksStored | None:
    if fields.get("medium") not in _INDEXED_MEDIA:
        return None
    hashes = _hashes(fields.get("block_hashes"))
    tokens, block_size = fields.get("token_ids"), fields.get("block_size")
    if not isinstance(tokens, list) or type(block_size) is not int or block_size <= 0:
        raise MalformedBatch("stored_fields")
    if len(tokens) != len(hashes) * block_size or not _token_ids(tokens):
        raise MalformedBatch("stored_tokens")
    parent = fields.get("parent_block_hash")
    lora_name = fields.get("lora_name")
    if lora_name is not None and not isinstance(lora_name, str):
        raise MalformedBatch("stored_fields")
    salt, plain = _scope(fields.get("extra_keys"), len(hashes), lora_name, parent is None)
    plain = plain and fields.get("group_idx") in (None, 0)
    plain = plain and (lora_name is not None or fields.get("lora_id") is None)
    return BlocksStored(
        hashes,
        None if parent is None else engine_hash(parent),
        tuple(tokens),
        block_size,
        plain,
        lora_name,
        salt,
    )


def _scope(
    extra: object, blocks: int, lora_name: str | None, first: bool
) -> tuple[str | None, bool]:
    """(the cache salt, whether every block's extra keys are its adapter and salt alone).

    vLLM's extra keys of a block, one entry per block: None, or the adapter's name, then any
    multimodal identifiers, then the salt (first block only), then a prompt-embeds hash."""
    if extra is None:
        return None, True  # vLLM before per-block extra keys: the adapter is all it tells
    if not isinstance(extra, list) or len(extra) != blocks:
        raise MalformedBatch("extra_keys")
    adapter = [] if lora_name is None else [lora_name]
    salt: str | None = None
    for position, keys in enumerate(extra):
        if keys is not None and not isinstance(keys, list):
            raise MalformedBatch("extra_keys")
        rest = keys or []
        if rest[: len(adapter)] != adapter:
            return None, False
        rest = rest[len(adapter) :]
        if position == 0 and first and len(rest) == 1 and isinstance(rest[0], str):
            salt = rest[0]
        elif rest:
            return None, False
    return salt, True


def _token_ids(tokens: list[Any]) -> bool:
    """Every item a token id, an int of 0 to 2**32 - 1 (a bool is no token), checked in C: a
    batch may hold 10**6 of them."""
    if not set(map(type, tokens)) <= {int}:
        return False
    try:
        array("I", tokens)
    except OverflowError:
        return False
    return True


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise MalformedBatch("block_hashes")
    return tuple(engine_hash(v) for v in value)


# Older vLLM wrote events as arrays in field order: the names of the fields the index reads.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
}
