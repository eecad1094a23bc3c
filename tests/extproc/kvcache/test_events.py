"""Decoding vLLM's KV event batches: both encodings, tolerance of the unknown, and rejection of
what is not a batch."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.kvcache.events import (
    MAX_EVENTS_PER_BATCH,
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    MalformedBatch,
    decode_batch,
)
from tests.extproc.kvcache.kv_events_helpers import BLOCK, batch, cleared, removed, stored


def test_a_batch_decodes_to_its_blocks() -> None:
    decoded = decode_batch(
        batch(stored([b"\x01" * 32, 7], None, list(range(8))), removed([7]), cleared(), ts=12.5)
    )
    assert decoded.ts == 12.5
    assert decoded.events == (
        BlocksStored((0x0101010101010101 & (2**60 - 1), 7), None, tuple(range(8)), 4, True),
        BlocksRemoved((7,)),
        AllCleared(),
    )


def test_bytes_and_int_hashes_name_the_same_block() -> None:
    # vLLM's int form is the low 64 bits of the bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    digest = bytes(range(32))
    as_int = int.from_bytes(digest, "big") & (2**64 - 1)
    (a,) = decode_batch(batch(removed([digest]))).events
    (b,) = decode_batch(batch(removed([as_int]))).events
    assert a == b


def test_older_array_encoding_decodes_too() -> None:
    payload = msgpack.packb(
        [
            3.0,
            [
                ["BlockStored", [5, 6], 4, list(range(8)), 4, None, "GPU"],
                ["BlockRemoved", [5], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    assert decode_batch(payload).events == (
        BlocksStored((5, 6), 4, tuple(range(8)), 4, True),
        BlocksRemoved((5,)),
        AllCleared(),
    )


def test_unknown_tags_and_fields_are_skipped_not_errors() -> None:
    decoded = decode_batch(
        batch(
            {"type": "BlockMoved", "x": 1},
            stored([1], None, [1, 2, 3, 4], session_id="s", future=[1, 2]),
            stored([2], None, [1, 2, 3, 4], medium="CPU"),
        )
    )
    assert decoded.events == (BlocksStored((1,), None, (1, 2, 3, 4), 4, True),)
    assert decoded.skipped == 2


def test_a_clients_long_session_id_does_not_refuse_the_batch() -> None:
    """vLLM copies a request's session_id, any length, into its BlockStored events."""
    decoded = decode_batch(
        batch(stored([1], None, [1, 2, 3, 4], session_id="s" * 100_000), removed([9]))
    )
    assert decoded.events == (BlocksStored((1,), None, (1, 2, 3, 4), 4, True), BlocksRemoved((9,)))


def test_blocks_carry_their_adapter_and_salt_as_vllms_extra_keys_tell() -> None:
    """vLLM's extra keys of a block: the adapter's name on every block, then the cache salt on
    the first (a block with no parent)."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    decoded = decode_batch(
        batch(
            stored([1, 2], None, tokens, lora_name="a", lora_id=3, extra_keys=[["a"], ["a"]]),
            stored([3, 4], None, tokens, extra_keys=[["salt"], None]),
            stored([5, 6], None, tokens, lora_name="a", extra_keys=[["a", "s"], ["a"]]),
            stored([7], None, tokens[:4], lora_name="a"),  # vLLM before per-block extra keys
        )
    )
    scopes = [(e.plain, e.lora_name, e.cache_salt) for e in decoded.events]  # type: ignore[union-attr]
    assert scopes == [(True, "a", None), (True, None, "salt"), (True, "a", "s"), (True, "a", None)]


@pytest.mark.parametrize(
    "fields",
    [
        {"lora_id": 3},  # an adapter without its name: its key is unknown
        {"extra_keys": [[["image-uuid", 0]]]},  # multimodal input
        {"extra_keys": [["mm-hash", "salt"]]},  # more than a salt
        {"lora_name": "a", "extra_keys": [["b"]]},  # another adapter's keys
        {"group_idx": 1},
    ],
)
def test_blocks_keyed_by_what_a_request_cannot_name_are_marked(fields: dict[str, Any]) -> None:
    [event] = decode_batch(batch(stored([1], None, [1, 2, 3, 4], **fields))).events
    assert isinstance(event, BlocksStored) and not event.plain


def test_a_salt_below_the_first_block_is_no_salt() -> None:
    """vLLM puts the salt in the first block's keys only: a child block with one is not
    keyed as a request can name it."""
    [event] = decode_batch(batch(stored([2], 1, [1, 2, 3, 4], extra_keys=[["salt"]]))).events
    assert isinstance(event, BlocksStored) and not event.plain and event.cache_salt is None


@pytest.mark.parametrize(
    "extra_keys",
    [{"salt": 1}, "salt", [["a"], ["b"]], [7], [{"k": 1}]],
)
def test_extra_keys_of_another_shape_are_malformed(extra_keys: object) -> None:
    with pytest.raises(MalformedBatch) as caught:
        decode_batch(batch(stored([1], None, [1, 2, 3, 4], extra_keys=extra_keys)))
    assert caught.value.reason == "extra_keys"


def test_a_lora_name_that_is_no_string_is_malformed() -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(batch(stored([1], None, [1, 2, 3, 4], lora_name=7)))


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", "msgpack"),
        (b"", "msgpack"),  # nothing at all
        (msgpack.packb([1.0, []])[:-1], "msgpack"),  # cut short before its events
        (msgpack.packb({"ts": 1}), "not_a_batch"),
        (msgpack.packb([1.0]), "not_a_batch"),
        (msgpack.packb(["x", []]), "not_a_batch"),
        (msgpack.packb([1.0, [7]]), "event_shape"),
        (batch(stored([1], None, [1, 2, 3])), "stored_tokens"),
        (batch(stored([1], None, [1, 2, 3, "x"])), "stored_tokens"),
        (batch(stored([1.5], None, [1, 2, 3, 4])), "hash_type"),
        (batch(stored([], None, [])), "block_hashes"),
        (batch(stored([1], None, [1, 2, 3, 4], block_size=0)), "stored_fields"),
        (batch(stored([1], None, [1, 2, 3, 4], lora_name=7)), "stored_fields"),
        (batch(removed([b""])), "empty_hash"),
        (msgpack.packb([1.0, [{1: "BlockRemoved"}]]), "msgpack"),  # a key that is no string
        (batch(removed([1] * ((1 << 18) + 1))), "msgpack"),  # an array past the decoder's bound
        (msgpack.packb([1.0, [{f"k{n}": n for n in range(65)}]]), "msgpack"),  # a map too
        (msgpack.packb([1.0, [msgpack.ExtType(1, b"x")]]), "msgpack"),  # no extension types
        (msgpack.packb([1.0, [cleared()] * (MAX_EVENTS_PER_BATCH + 1)]), "too_many_events"),
        (batch(removed([b"\x01" * 2000])), "msgpack"),  # a bin longer than any hash
        (batch() + b"\x00", "msgpack"),  # trailing bytes
        (batch()[:-2] + b"\x91" * 100_000 + b"\xc0", "msgpack"),  # an event nested too deep
    ],
)
def test_what_is_not_a_batch_is_rejected_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(MalformedBatch) as raised:
        decode_batch(payload)
    assert raised.value.reason == reason
    assert str(raised.value) == reason  # what a log line or a traceback shows


def test_a_removal_from_another_tier_is_skipped() -> None:
    """KV offloading: a block's CPU copy evicted says nothing of its GPU copy, which still
    counts as cached."""
    decoded = decode_batch(batch(removed([7]) | {"medium": "CPU"}, removed([8])))
    assert decoded.events == (BlocksRemoved((8,)),)
    assert decoded.skipped == 1


# Any msgpack value, as a hostile or broken publisher could send it.
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=30,
)
_FIELDS = (
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "x"])


@st.composite
def _near_events(draw: st.DrawFn) -> Any:
    """An event as vLLM writes it (a tagged map, or an older tagged array) with any of its
    fields replaced by anything: the shapes that reach the decoder's every check."""
    event = stored([1, 2], draw(st.none() | st.integers(0, 9)), list(range(2 * BLOCK)))
    event["type"] = draw(_TAGS)
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=3)):
        event[name] = draw(_SCALARS | _VALUES)
    if draw(st.booleans()):
        return [event.pop("type"), *event.values()]
    return event


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        _VALUES,
        st.lists(_near_events(), min_size=1, max_size=3).map(lambda events: [1.0, events, 0]),
        st.lists(_VALUES, max_size=4).map(lambda events: [1.0, events]),
    )
)
def test_any_msgpack_decodes_or_is_rejected_as_malformed(value: Any) -> None:
    """Whatever the shape: a batch, or MalformedBatch (never another exception, which would
    end the engine's subscriber)."""
    try:
        decoded = decode_batch(msgpack.packb(value))
    except MalformedBatch:
        return
    assert all(isinstance(e, BlocksStored | BlocksRemoved | AllCleared) for e in decoded.events)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_rejected_as_malformed(payload: bytes) -> None:
    with contextlib.suppress(MalformedBatch):
        decode_batch(payload)


@pytest.mark.parametrize(
    "bad",
    [
        {"extra_keys": 5},
        {"extra_keys": "salt"},
        {"extra_keys": {"a": 1}},
        {"token_ids": [{"a": 1}] * 4},
        {"token_ids": [1, 2, 3, 2**64 - 1]},
        {"token_ids": [1, 2, 3, -1]},
        {"token_ids": [1, 2, 3, True]},
        {"block_size": True, "token_ids": [1]},
    ],
)
def test_wrong_types_in_a_block_stored_are_malformed(bad: dict[str, Any]) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(batch(stored([1], None, [1, 2, 3, 4]) | bad))


def test_removals_of_another_kv_cache_group_are_skipped() -> None:
    # a hybrid model's other groups (sliding window, mamba) key blocks of their own
    other = decode_batch(batch({**removed([7]), "group_idx": 1}))
    assert (other.events, other.skipped) == ((), 1)
    assert decode_batch(batch({**removed([7]), "group_idx": 0})).events == (BlocksRemoved((7,)),)


def test_blocks_of_one_token_decode() -> None:
    (event,) = decode_batch(batch(stored([1, 2], None, [5, 6], block_size=1))).events
    assert event == BlocksStored((1, 2), None, (5, 6), 1, True)


def test_a_batch_of_as_many_events_as_allowed_decodes() -> None:
    payload = msgpack.packb([1.0, [cleared()] * MAX_EVENTS_PER_BATCH])
    assert len(decode_batch(payload).events) == MAX_EVENTS_PER_BATCH
