"""Build the P and D bodies from the client's raw JSON without re-serialising the prompt.

A 1 MB prompt costs ~22 ms to json.loads+dumps and ~0.5 ms to splice (measured). So the
top-level members of the client's object are located once (`members`), each member's raw
bytes are kept as they are, members the sidecar owns are dropped, and the injected members
are appended. A string is skipped by finding its quotes with `bytes.find` (memchr: a 200 KB
prompt in ~5 µs, where the string regex took ~2 ms), other values with C-speed regexes, so the
prompt itself is never walked character by character in Python.

Keys are compared after JSON-decoding, so an escaped key (`"kv\\u005ftransfer_params"`)
cannot smuggle a field past the filter.

A leg's body is kept as the pieces it joins (`Spliced`): views into the client's body and the
sidecar's own members. It is joined only where one buffer is needed (a buffered answer to
Envoy); P's is written to the socket piece by piece and D's streamed answer cut into chunks
from them, so a long prompt costs no whole copy per leg.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "MAX_DEPTH",
    "Member",
    "Raw",
    "Spliced",
    "buffer_bytes",
    "container_end",
    "decode_body",
    "members",
    "prefill_body",
    "prefill_kv_params",
    "splice",
    "without_router_xargs",
]

# A body as gathered: bytes, or the upload's own buffer (not copied into bytes first).
Raw = bytes | bytearray
# One top-level member, `"key": value`, as raw bytes: a view into the body it came from (a
# long prompt's bytes are not copied out of the body), or bytes of its own.
Member = tuple[str, bytes | memoryview]

_WS = re.compile(rb"[ \t\n\r]*")
# Strings as "runs of plain bytes, then one escape": the regex engine stays in its fast
# character-class loop (4-5x quicker than one alternation per byte on a long prompt).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SCALAR = re.compile(rb"[^,}\]\s]+")
# `_string_end` looks past this many escaped quotes, or a backslash run this long, before it
# leaves the string to `_STRING` (linear in C): no input makes its Python loop long.
_QUOTES_TRIED = 64
_BACKSLASH_RUN = 16
_QUOTE, _BACKSLASH, _OPENERS = 0x22, 0x5C, (0x5B, 0x7B)
# Inside a container only strings and brackets matter.
_NEXT_STRUCTURAL = re.compile(rb'["\[\]{}]')
# The deepest JSON nesting a body may have (the body itself is one level; members() refuses a
# deeper one, with TooDeep): far beyond any
# request's (a tool's schema nests a few levels), far below what recursive code reaching the
# decoded body (a chat template rendering it; Python's recursion limit is 1,000) can take.
MAX_DEPTH = 64


def _container_pattern(depth: int) -> re.Pattern[bytes]:
    """A container nested at most `depth` deep (itself one level), as one regex: its loops are
    possessive, so the engine never backtracks and matches, over valid JSON, exactly the
    container or nothing. A long chat's messages take one pass in C instead of a Python step per
    string and bracket (10^5 messages: 0.3 s of the event loop)."""
    string = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
    inside = rb'(?:[^{}\[\]"]++|' + string + rb")*+"
    for _ in range(depth - 1):
        inside = rb'(?:[^{}\[\]"]++|' + string + rb"|[\[{]" + inside + rb"[\]}])*+"
    return re.compile(rb"[\[{]" + inside + rb"[\]}]")


_CONTAINER = _container_pattern(MAX_DEPTH - 1)  # a member's value: the body is one level


def container_end(raw: Raw, pos: int) -> int | None:
    """Where the container opening at raw[pos] ends, if it nests at most MAX_DEPTH - 1 deep
    (a member's value); else (or if it is not valid JSON) None."""
    match = _CONTAINER.match(raw, pos)
    return None if match is None else match.end()


# Fields of the client body that only the sidecar may set: the KV connector's parameters and
# the encoder-cache connector's (E/P/D), which tell an engine where to send or fetch caches.
ROUTER_FIELDS = frozenset({"kv_transfer_params", "ec_transfer_params"})
# vLLM merges `vllm_xargs` into the sampling params' extra_args, where its connectors read
# these keys (the body's own fields win when set; decode-only, no field is set): only the
# sidecar may set them too. `kv_cache_report_mode` changes the KV events the index reads.
ROUTER_XARGS = frozenset({"kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode"})
_XARGS = "vllm_xargs"
# Fields the P leg overrides (vLLM rejects min_tokens > max_tokens, so they go).
_PREFILL_DROPPED = ROUTER_FIELDS | {
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "min_completion_tokens",
}


class BodyError(ValueError):
    """The bytes are not a single JSON object (callers parse with orjson first)."""


class TooDeep(BodyError):
    """A member's value nests deeper than MAX_DEPTH (the body counting as one level)."""


def _string_end(raw: Raw, pos: int) -> int | None:
    """The end of the JSON string whose opening quote is raw[pos]; None if it never closes.
    A quote ends it unless an odd run of backslashes precedes it (then it is escaped)."""
    start = pos + 1
    for _ in range(_QUOTES_TRIED):
        quote = raw.find(b'"', start)
        if quote < 0:
            return None
        run = 0  # the walk back stops at raw[pos] at the latest: a quote
        while run < _BACKSLASH_RUN and raw[quote - 1 - run] == _BACKSLASH:
            run += 1
        if run == _BACKSLASH_RUN:
            break
        if run % 2 == 0:
            return quote + 1
        start = quote + 1
    match = _STRING.match(raw, pos)
    return None if match is None else match.end()


def _skip_container(raw: Raw, pos: int) -> int:
    depth = 0
    while (match := _NEXT_STRUCTURAL.search(raw, pos)) is not None:
        token = raw[match.start()]
        if token == _QUOTE:
            end = _string_end(raw, match.start())
            if end is None:
                break
            pos = end
            continue
        pos = match.end()
        if token in _OPENERS:
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return pos
    raise BodyError("unterminated container")


def _skip_value(raw: Raw, pos: int, valid: bool) -> int:
    first = raw[pos : pos + 1]
    if first == b'"':
        end = _string_end(raw, pos)
        if end is None:
            raise BodyError(f"bad value at byte {pos}")
        return end
    if first in (b"{", b"["):
        end = container_end(raw, pos)
        if end is None and valid:
            raise TooDeep(f"the value at byte {pos} nests more than {MAX_DEPTH} levels deep")
        return _skip_container(raw, pos) if end is None else end
    match = _SCALAR.match(raw, pos)
    if match is None:
        raise BodyError(f"bad value at byte {pos}")
    return match.end()


def _key_text(raw_key: Raw) -> str:
    inner = raw_key[1:-1]
    return orjson.loads(raw_key) if b"\\" in inner else inner.decode()


def _after_ws(raw: Raw, pos: int) -> int:
    match = _WS.match(raw, pos)
    assert match is not None  # "[ \t\n\r]*" matches the empty string too
    return match.end()


def members(raw: Raw, valid: bool = False) -> list[Member]:
    """The top-level (key, raw 'key: value' bytes) pairs of a JSON object, in order. `valid`:
    orjson accepted `raw`, so a container the depth-bounded pattern does not match is too
    deep (TooDeep), not malformed. Each member is a view into `raw`, which it keeps: the
    legs' bodies are then the body's only copies (a 10 MB prompt copied out here had eight
    concurrent ones cost 80 MB of fresh pages)."""
    view = memoryview(raw)
    pos = _after_ws(raw, 0)
    if raw[pos : pos + 1] != b"{":
        raise BodyError("not a JSON object")
    pos = _after_ws(raw, pos + 1)
    found: list[Member] = []
    if raw[pos : pos + 1] == b"}":
        return found
    while True:
        key_match = _STRING.match(raw, pos)
        if key_match is None:
            raise BodyError(f"expected a key at byte {pos}")
        colon = _after_ws(raw, key_match.end())
        value_start = _after_ws(raw, colon + 1)
        value_end = _skip_value(raw, value_start, valid)
        found.append((_key_text(key_match.group()), view[key_match.start() : value_end]))
        pos = _after_ws(raw, value_end)
        if raw[pos : pos + 1] == b"}":
            return found
        if raw[pos : pos + 1] != b",":
            raise BodyError(f"expected ',' or '}}' at byte {pos}")
        pos = _after_ws(raw, pos + 1)


def without_router_xargs(parts: list[Member], xargs: Any) -> list[Member]:
    """`parts` with the router's keys taken out of `vllm_xargs` (`xargs`: its decoded value,
    the last member's, as an engine's JSON parser takes it); unchanged when it has none."""
    if not isinstance(xargs, dict) or ROUTER_XARGS.isdisjoint(xargs):
        return parts
    kept = [(key, chunk) for key, chunk in parts if key != _XARGS]
    rest = {key: value for key, value in xargs.items() if key not in ROUTER_XARGS}
    if rest:
        kept.append((_XARGS, orjson.dumps(_XARGS) + b":" + orjson.dumps(rest)))
    return kept


@dataclass(frozen=True, slots=True)
class Spliced:
    """A JSON body as the pieces it joins, in order; `size`: its length in bytes."""

    pieces: tuple[bytes | memoryview, ...]
    size: int

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)

    def chunks(self, size: int) -> Iterator[bytes]:
        """The body in chunks of `size` bytes (the last one shorter; one empty chunk for an
        empty body), each joined when asked for."""
        chunk: list[memoryview] = []
        held = 0
        for piece in self.pieces:
            view = memoryview(piece)
            while view:
                taken = view[: size - held]
                chunk.append(taken)
                held += len(taken)
                view = view[len(taken) :]
                if held == size:
                    yield b"".join(chunk)
                    chunk, held = [], 0
        if chunk or not self.size:
            yield b"".join(chunk)


def splice(parts: Iterable[Member], drop: frozenset[str], add: Mapping[str, Any]) -> Spliced:
    """Re-assemble an object: kept members verbatim, then `add` serialised by orjson; as its
    pieces, not joined (a long prompt is not copied here)."""
    pieces: list[bytes | memoryview] = [b"{"]
    for key, chunk in parts:
        if key not in drop and key not in add:
            pieces += (chunk, b",")
    for key, value in add.items():
        pieces += (orjson.dumps(key), b":", orjson.dumps(value), b",")
    if len(pieces) > 1:
        pieces.pop()  # the last comma
    pieces.append(b"}")
    return Spliced(tuple(pieces), sum(len(piece) for piece in pieces))


def prefill_body(
    parts: list[Member], has_max_completion_tokens: bool, kv_params: Mapping[str, Any]
) -> Spliced:
    """The P leg: one token, not streamed, no min_tokens, and the router's kv_transfer_params."""
    add: dict[str, Any] = {"max_tokens": 1, "stream": False}
    if has_max_completion_tokens:
        add["max_completion_tokens"] = 1
    add["kv_transfer_params"] = kv_params
    return splice(parts, _PREFILL_DROPPED, add)


def prefill_kv_params(transfer_id: str | None = None) -> dict[str, Any]:
    """The P leg's kv_transfer_params: "prefill only, a decode will fetch or receive it".

    P reads only do_remote_decode; the null keys are the convention of vLLM's own proxies.
    """
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    if transfer_id is not None:
        params["transfer_id"] = transfer_id  # pairs the legs in vLLM versions after 0.33
    return params


def decode_body(parts: list[Member], kv_params: Mapping[str, Any] | None) -> Spliced:
    """The D leg: the client's body, its own kv_transfer_params replaced by the router's."""
    add = {} if kv_params is None else {"kv_transfer_params": kv_params}
    return splice(parts, ROUTER_FIELDS, add)


def buffer_bytes(max_body_bytes: int) -> int:
    """Envoy's request buffer for a client body limit: the limit plus what splicing adds.

    The P body adds under 300 bytes and a parallel D body under 1 KiB (the identity's fields
    are length-checked). A serial D body carries P's kv_transfer_params verbatim, whose
    remote_block_ids name one KV block per 16 prompt tokens: a few bytes per ~64 bytes of
    prompt, so an eighth of the limit covers it with room to spare.
    """
    return max_body_bytes + 64 * 1024 + max_body_bytes // 8
