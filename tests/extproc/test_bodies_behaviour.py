"""What the P and D legs' bodies tell the engines, beyond the splice itself."""

from __future__ import annotations

import orjson
import pytest

from extproc.protocol.bodies import BodyError, members, prefill_body, prefill_kv_params


def test_p_is_asked_to_prefill_for_a_remote_decode() -> None:
    """P keeps the KV for a decode elsewhere and does not itself fetch KV (spec §3)."""
    params = prefill_kv_params("xfer-1")
    assert params["do_remote_decode"] is True
    assert params["do_remote_prefill"] is False
    assert params["transfer_id"] == "xfer-1"  # pairs P's lease with D's request


def test_without_a_transfer_id_p_gets_none_to_pair_with() -> None:
    params = prefill_kv_params()
    assert "transfer_id" not in params
    assert params["do_remote_decode"] is True


def test_p_body_carries_the_params_given() -> None:
    raw = b'{"model":"m","prompt":"p","kv_transfer_params":{"do_remote_decode":false}}'
    body = orjson.loads(prefill_body(members(raw), False, prefill_kv_params("t")))
    assert body["kv_transfer_params"] == prefill_kv_params("t")


@pytest.mark.parametrize("raw", [b"{}", b"{}\n", b" \r\n\t{ \n}  \n"])
def test_empty_object_with_any_whitespace_around_it(raw: bytes) -> None:
    assert members(raw) == []


def test_trailing_newline_after_the_object_is_accepted() -> None:
    """`curl -d @request.json` sends the file's final newline."""
    raw = b'{"model": "m",\n "prompt": "p"}\n'
    assert members(raw) == [("model", b'"model": "m"'), ("prompt", b'"prompt": "p"')]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b" [1]", "not a JSON object"),
        (b'{"a": [1, {"b": 2}', "unterminated container"),
        (b'{"a": }', "bad value at byte 6"),
        (b'{"a": "unterminated}', "bad value at byte 6"),
        (b"{ 1: 2}", "expected a key at byte 2"),
        (b'{"a": 1, }', "expected a key at byte 9"),
        (b'{"a": 1 "b": 2}', "expected ',' or '}' at byte 8"),
    ],
)
def test_malformed_objects_name_the_byte_where_scanning_stopped(raw: bytes, message: str) -> None:
    with pytest.raises(BodyError) as caught:
        members(raw)
    assert str(caught.value) == message
