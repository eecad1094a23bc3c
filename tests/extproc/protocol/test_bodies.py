"""The P and D legs' bodies: the splice always equals 'parse, change the fields, serialise'
without re-serialising, and what the bodies tell the engines."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.protocol.bodies import (
    BodyError,
    Spliced,
    TooDeep,
    container_end,
    decode_body,
    members,
    prefill_body,
    prefill_kv_params,
    without_router_xargs,
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text()
    | st.floats(allow_nan=False, allow_infinity=False)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
bodies = st.dictionaries(
    st.sampled_from(
        [
            "model",
            "prompt",
            "messages",
            "stream",
            "stream_options",
            "max_tokens",
            "max_completion_tokens",
            "min_tokens",
            "kv_transfer_params",
            "ec_transfer_params",
            "temperature",
            "x",
        ]
    )
    | st.text(max_size=8),
    json_values,
    max_size=8,
)
KV = {"do_remote_decode": True, "remote_host": None}


def _serialise(doc: dict, pretty: bool) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 if pretty else 0)


@settings(max_examples=400, deadline=None)
@given(doc=bodies, pretty=st.booleans())
def test_decode_body_is_the_original_plus_the_routers_params(doc: dict, pretty: bool) -> None:
    raw = _serialise(doc, pretty)
    out = orjson.loads(bytes(decode_body(members(raw), KV)))
    assert out == {
        **{k: v for k, v in doc.items() if k not in ("kv_transfer_params", "ec_transfer_params")},
        "kv_transfer_params": KV,
    }


@settings(max_examples=400, deadline=None)
@given(doc=bodies, pretty=st.booleans())
def test_prefill_body_caps_tokens_and_drops_streaming(doc: dict, pretty: bool) -> None:
    raw = _serialise(doc, pretty)
    has_mct = "max_completion_tokens" in doc
    out = orjson.loads(bytes(prefill_body(members(raw), has_mct, KV)))
    dropped = {
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "min_completion_tokens",
        "kv_transfer_params",
        "ec_transfer_params",
    }
    expected = {k: v for k, v in doc.items() if k not in dropped}
    expected |= {"max_tokens": 1, "stream": False, "kv_transfer_params": KV}
    if has_mct:
        expected["max_completion_tokens"] = 1
    assert out == expected


def test_prompt_bytes_are_kept_verbatim() -> None:
    raw = b'{"model":"m","prompt":"caf\\u00e9 \\"quoted\\" \\\\ {not a brace}","stream":true}'
    out = bytes(decode_body(members(raw), None))
    assert b'"prompt":"caf\\u00e9 \\"quoted\\" \\\\ {not a brace}"' in out


def test_an_uploads_buffer_is_read_in_place_and_its_members_are_views_into_it() -> None:
    raw = b'{"model": "m", "prompt": "a \\" b", "n": [1, {"x": 2}]}'
    upload = bytearray(raw)  # the gathered upload, not copied into bytes
    found = members(upload, valid=True)
    assert found == members(raw, valid=True)
    assert [key for key, _ in found] == ["model", "prompt", "n"]
    assert [bytes(chunk) for _, chunk in found] == [
        b'"model": "m"',
        b'"prompt": "a \\" b"',
        b'"n": [1, {"x": 2}]',
    ]
    # no member is a copy: a 10 MB prompt costs the body's own bytes only
    assert all(isinstance(chunk, memoryview) and chunk.obj is upload for _, chunk in found)


def test_escaped_key_cannot_smuggle_router_fields() -> None:
    raw = b'{"model":"m","kv\\u005ftransfer_params":{"remote_host":"evil"},"prompt":"p"}'
    out = orjson.loads(bytes(decode_body(members(raw), None)))
    assert "kv_transfer_params" not in out


def test_duplicate_router_keys_are_all_removed() -> None:
    raw = b'{"kv_transfer_params":1,"model":"m","kv_transfer_params":{"a":2}}'
    assert orjson.loads(bytes(decode_body(members(raw), {"b": 3}))) == {
        "model": "m",
        "kv_transfer_params": {"b": 3},
    }


def test_the_encoder_cache_params_are_the_routers_too() -> None:
    raw = b'{"model":"m","ec\\u005ftransfer_params":{"remote_host":"evil"},"prompt":"p"}'
    for body in (decode_body(members(raw), None), prefill_body(members(raw), False, KV)):
        assert "ec_transfer_params" not in orjson.loads(bytes(body))


def _xargs_of(raw: bytes) -> object:
    parts = without_router_xargs(members(raw), orjson.loads(raw).get("vllm_xargs"))
    return orjson.loads(bytes(decode_body(parts, None))).get("vllm_xargs", "absent")


def test_vllm_xargs_cannot_carry_the_routers_params() -> None:
    # vLLM merges vllm_xargs into extra_args, where its connectors read these keys
    raw = (
        b'{"model":"m","vllm_xargs":{"kv_transfer_params":"x","ec_transfer_params":"y",'
        b'"kv_cache_report_mode":"full","mine":[1,"a"]},"prompt":"p"}'
    )
    assert _xargs_of(raw) == {"mine": [1, "a"]}
    # escaped keys, duplicated members (a parser takes the last), nothing left
    escaped = b'{"vllm_xargs":{"a":1},"vllm_xargs":{"kv\\u005ftransfer_params":"x"},"model":"m"}'
    assert _xargs_of(escaped) == "absent"


def test_vllm_xargs_without_router_keys_are_left_as_sent() -> None:
    raw = b'{"model":"m","vllm_xargs": {"mine" : 1},"prompt":"p"}'
    parts = members(raw)
    assert without_router_xargs(parts, {"mine": 1}) is parts
    assert without_router_xargs(parts, "not an object") is parts


@pytest.mark.parametrize("raw", [b"[]", b'"x"', b"{", b'{"a" 1}', b'{"a":1 "b":2}'])
def test_non_objects_are_rejected(raw: bytes) -> None:
    with pytest.raises(BodyError):
        members(raw)


def test_one_megabyte_prompt_is_spliced_without_reparsing() -> None:
    raw = orjson.dumps({"model": "m", "prompt": "word " * 200_000, "stream": True})
    parts = members(raw)
    assert [k for k, _ in parts] == ["model", "prompt", "stream"]
    assert parts[1][1] in raw  # the prompt member is a slice of the input, not a copy


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
    body = orjson.loads(bytes(prefill_body(members(raw), False, prefill_kv_params("t"))))
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


ESCAPED = [
    'a"b',  # an escaped quote
    "ends in a backslash \\",  # \\ right before the closing quote
    "\\" * 7 + '"',  # an odd run: the quote is escaped
    "\\" * 20,  # a run past the walk's bound: the regex decides
    "\\" * 21 + '" and on',
    'say "hi" ' * 100,  # more escaped quotes than the fast path looks past
    '[{"nested": "]}"}]',  # brackets and quotes inside a string
    "line\nline\ttab \u2028 \x00",
]


@pytest.mark.parametrize("text", ESCAPED)
@pytest.mark.parametrize("where", ["prompt", "messages"])
def test_strings_with_escapes_end_where_json_says(text: str, where: str) -> None:
    value = text if where == "prompt" else [{"role": "user", "content": text}, {"x": [text]}]
    doc = {"model": "m", where: value, "after": "a\\", "n": 1}
    parts = members(orjson.dumps(doc))
    assert [key for key, _ in parts] == list(doc)
    for key, chunk in parts:
        assert orjson.loads(b"{" + chunk + b"}") == {key: doc[key]}


def test_vllm_xargs_carrying_only_the_report_mode_lose_it() -> None:
    # kv_cache_report_mode changes the KV events the index reads: only the sidecar sets it,
    # even in xargs that carry no kv_transfer_params
    raw = b'{"model":"m","vllm_xargs":{"kv_cache_report_mode":"all","mine":1}}'
    assert _xargs_of(raw) == {"mine": 1}
    assert _xargs_of(b'{"model":"m","vllm_xargs":{"kv_cache_report_mode":"all"}}') == "absent"


def test_a_long_chat_is_split_as_written() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": 'a [b] {c "d" \\" \\\\'}]},
        {"role": "assistant", "content": "x]}", "tool_calls": [{"f": {"a": [1, {"b": None}]}}]},
    ] * 20_000
    raw = orjson.dumps({"model": "m", "messages": messages, "n": 1})
    messages_raw = orjson.dumps({"messages": messages})[1:-1]
    assert members(raw) == [("model", b'"model":"m"'), ("messages", messages_raw), ("n", b'"n":1')]


def test_a_member_nested_past_the_limit_is_refused_and_one_at_it_is_split() -> None:
    deepest = b'{"a":' + b"[" * 63 + b"]" * 63 + b',"b":1}'  # 64 levels with the body
    assert members(deepest) == [("a", b'"a":' + b"[" * 63 + b"]" * 63), ("b", b'"b":1')]
    too_deep = b'{"a":' + b"[" * 64 + b"]" * 64 + b',"b":1}'
    assert container_end(too_deep, 5) is None
    with pytest.raises(TooDeep):
        members(too_deep, valid=True)  # orjson accepted it: too deep, not malformed


@pytest.mark.parametrize("size", [0, 1, 5, 6, 7, 13])
def test_a_spliced_body_is_cut_into_chunks_that_join_to_it(size: int) -> None:
    """D's streamed answer: chunks of 6 bytes across the pieces' bounds, the last shorter,
    one empty chunk for an empty body."""
    whole = bytes(range(size))
    pieces = (whole[:2], memoryview(whole)[2:9], whole[9:])
    body = Spliced(tuple(p for p in pieces if len(p)), size)
    chunks = list(body.chunks(6))
    assert b"".join(chunks) == whole == bytes(body) and len(body) == size
    expected = [6] * (size // 6) + ([size % 6] if size % 6 else []) or [0]
    assert [len(chunk) for chunk in chunks] == expected


def test_an_empty_object_stays_an_object() -> None:
    assert bytes(decode_body(members(b"{}"), None)) == b"{}"
    assert bytes(decode_body(members(b" { } "), {"a": 1})) == b'{"kv_transfer_params":{"a":1}}'
