"""Parse the client's OpenAI request once and refuse what P/D cannot serve.

Everything refused here gets a 4xx with an OpenAI-style body and never reaches an engine.
Only the fields the sidecar reads or rewrites are checked; the engines validate the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from extproc.errors import ClientError
from extproc.protocol.bodies import (
    MAX_DEPTH,
    BodyError,
    Member,
    Raw,
    TooDeep,
    members,
    without_router_xargs,
)

__all__ = [
    "PASSTHROUGH",
    "Api",
    "ClientRequest",
    "client_request",
    "decode_request",
    "is_passthrough",
    "parse_request",
]


class Api(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


PATHS = frozenset(api.value for api in Api)
# Engine endpoints that need no P/D routing (any decode engine answers them), each with the one
# method it serves. Matched exactly, on the normalised path and that method, so that no other
# target and no client body meant for a completion reaches an engine past the ext_proc. An
# engine's /metrics is not one of them: its numbers are one engine's of many, picked at random
# per scrape, and an operator's (Prometheus scrapes the engines and the sidecar directly).
PASSTHROUGH = {
    "/v1/models": "GET",
    "/health": "GET",
    "/version": "GET",
    "/tokenize": "POST",
    "/detokenize": "POST",
}


def is_passthrough(method: str, path: str) -> bool:
    return PASSTHROUGH.get(path.split("?", 1)[0]) == method


# Integer fields and their least value (`n` has its own check: it must be 1).
_INT_FIELDS = {"max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 0}
# The largest integer accepted (the largest signed 32-bit one): 2**31 - 1 tokens is orders of
# magnitude beyond any model's context length, so no request an engine could serve is refused;
# a larger value could only fail at D, after P has computed the prompt for nothing.
MAX_INT = 2**31 - 1
_MAX_INT_TEXT = f"the largest accepted is {MAX_INT} (2**31 - 1), beyond any context length"


@dataclass(frozen=True, slots=True)
class ClientRequest:
    api: Api
    model: str
    stream: bool
    doc: dict[str, Any]
    parts: list[Member]  # top-level members as raw bytes (see bodies.members)

    @property
    def has_max_completion_tokens(self) -> bool:
        return "max_completion_tokens" in self.doc


def check_route(method: str, path: str) -> Api:
    """The API for a method and path, or a 404/405 ClientError."""
    path = path.split("?", 1)[0]
    if path not in PATHS:
        raise ClientError(404, f"{path} is not served here; use {' or '.join(sorted(PATHS))}")
    if method != "POST":
        raise ClientError(405, f"{method} is not allowed on {path}; use POST")
    return Api(path)


def _bad(message: str, param: str | None = None) -> ClientError:
    return ClientError(400, message, param=param)


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages a client can act on."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _shown(value: Any) -> str:
    """A number as written, anything else by its JSON type."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return repr(value) if number else _json_type(value)


def _check_prompt(api: Api, doc: dict[str, Any]) -> None:
    if api is Api.CHAT:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        if not set(map(type, messages)) <= {dict}:  # in C: 10^5 messages in ~2 ms
            raise _bad("each message must be an object", "messages")
        return
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list):
        what = _json_type(prompt) if "prompt" in doc else "missing"
        raise _bad(f"'prompt' must be a string or a list of token ids (it is {what})", "prompt")
    if not prompt:
        raise _bad("'prompt' is an empty list; send a string or a list of token ids", "prompt")
    if all(isinstance(item, str | list) for item in prompt):
        raise _bad(_prompt_list_message(len(prompt)), "prompt")
    if not set(map(type, prompt)) <= {int}:  # in C: a long list costs the loop little
        raise _bad("'prompt' as a list must hold token ids (integers) only", "prompt")
    smallest, largest = min(prompt), max(prompt)
    if smallest < 0 or largest > MAX_INT:
        wrong = smallest if smallest < 0 else largest
        raise _bad(
            f"'prompt' holds token id {wrong}; token ids are integers from 0 to {MAX_INT} "
            "and must be in the model's vocabulary",
            "prompt",
        )


def _prompt_list_message(count: int) -> str:
    if count == 1:
        return (
            "'prompt' is a list holding one prompt; send the prompt itself "
            "(a string or a list of token ids)"
        )
    return (
        f"'prompt' is a list of {count} prompts; prefill/decode serves one prompt per "
        "request: send each in its own request"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(doc: dict[str, Any], name: str, minimum: int) -> None:
    """`name` is absent, null or a JSON integer in [minimum, MAX_INT]."""
    value = doc.get(name)
    if value is None:
        return
    # orjson decodes integers beyond 64 bits (and 5.0, 1e3) as floats: the former are out of
    # range, not "not an integer" (their digits are not shown: the float has lost some).
    if isinstance(value, float) and value.is_integer() and abs(value) > MAX_INT:
        if value > 0:
            raise _bad(f"'{name}' is too large; {_MAX_INT_TEXT}", name)
        raise _bad(f"'{name}' must be at least {minimum}", name)
    if not _is_int(value):
        raise _bad(f"'{name}' must be an integer (it is {_shown(value)})", name)
    if value < minimum:
        raise _bad(f"'{name}' must be at least {minimum} (it is {value})", name)
    if value > MAX_INT:
        raise _bad(f"'{name}' is {value}, too large; {_MAX_INT_TEXT}", name)


def _check_fields(doc: dict[str, Any]) -> None:
    for name, minimum in _INT_FIELDS.items():
        _check_int(doc, name, minimum)
    n = doc.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise _bad(
            f"'n' is {_shown(n)}; prefill/decode serves one choice per request, so 'n' must "
            "be 1 (or left out)",
            "n",
        )
    stream = doc.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"'stream' must be true or false (it is {_json_type(stream)})", "stream")
    options = doc.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")


# Compressed bodies start with these bytes; Envoy passes them on undecoded, so they are named
# rather than reported as broken UTF-8.
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}


def _not_json(raw: Raw, error: orjson.JSONDecodeError) -> ClientError:
    """Why orjson refused the body, in the client's terms (runs only on this error path)."""
    for magic, name in _COMPRESSED.items():
        if raw.startswith(magic):
            return _bad(
                f"the body is {name}-compressed; send it uncompressed "
                "(compressed request bodies are not supported)"
            )
    try:
        raw.decode()
    except UnicodeDecodeError as bad:
        return _bad(
            f"the body is not UTF-8 text (byte 0x{raw[bad.start]:02x} at offset {bad.start}); "
            "send JSON encoded as UTF-8"
        )
    return _bad(f"the body is not valid JSON: {error}")


# vLLM's own scheduling priority (`extproc.headers.ENGINE_PRIORITY_HEADER`): the operator's.
_ENGINE_PRIORITY = "priority"


def parse_request(api: Api, raw: Raw, limit: int, engine_priority: bool = False) -> ClientRequest:
    """Parse and check a body; raises ClientError with the status the client should get.
    The client's `priority` is dropped from the legs' bodies unless `engine_priority`
    (dispatch.client_engine_priority)."""
    return client_request(api, raw, decode_request(api, raw, limit), engine_priority)


def decode_request(api: Api, raw: Raw, limit: int) -> dict[str, Any]:
    """The first half of `parse_request`: the body decoded and its fields checked. The halves
    are apart so that a big body's two long steps (decoding it, finding its members: 10^5 chat
    messages take ~50 ms each on a quiet core) can let the event loop run between them."""
    if len(raw) > limit:
        raise ClientError(413, f"request body is {len(raw)} bytes; the limit is {limit} bytes")
    if not raw:
        raise _bad("the request has no body; send a JSON object")
    try:
        doc = orjson.loads(raw)  # orjson also rejects bytes that are not UTF-8
    except orjson.JSONDecodeError as error:
        raise _not_json(raw, error) from None
    if not isinstance(doc, dict):
        raise _bad("the body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    _check_prompt(api, doc)
    _check_fields(doc)
    return doc


def client_request(
    api: Api, raw: Raw, doc: dict[str, Any], engine_priority: bool = False
) -> ClientRequest:
    """The second half of `parse_request`: `doc` (from `decode_request`) with the body's
    top-level members located for the legs' bodies."""
    try:
        parts = members(raw, valid=True)
    except TooDeep:
        raise _bad(
            f"the body's JSON is nested more than {MAX_DEPTH} levels deep; the limit is "
            f"{MAX_DEPTH}: flatten the deepest value"
        ) from None
    except BodyError as error:  # orjson accepted it, so this is our scanner's gap: say so
        raise _bad(f"unsupported JSON layout: {error}") from None
    parts = without_router_xargs(parts, doc.get("vllm_xargs"))
    if not engine_priority and _ENGINE_PRIORITY in doc:
        parts = [(key, chunk) for key, chunk in parts if key != _ENGINE_PRIORITY]
    return ClientRequest(api, doc["model"], bool(doc.get("stream")), doc, parts)
