"""Parse the client's OpenAI request once and refuse what P/D cannot serve.

Everything refused here gets a 4xx with an OpenAI-style body and never reaches an engine.
Only the fields the sidecar reads or rewrites are checked; the engines validate the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from extproc.bodies import BodyError, members
from extproc.errors import ClientError

__all__ = ["Api", "ClientRequest", "parse_request"]


class Api(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


PATHS = frozenset(api.value for api in Api)

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n")


@dataclass(frozen=True, slots=True)
class ClientRequest:
    api: Api
    model: str
    stream: bool
    doc: dict[str, Any]
    parts: list[tuple[str, bytes]]  # top-level members as raw bytes (see bodies.members)

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


def _check_prompt(api: Api, doc: dict[str, Any]) -> None:
    if api is Api.CHAT:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise _bad("each message must be an object", "messages")
        return
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return  # one prompt given as token ids
    if isinstance(prompt, list):
        raise _bad("a list of prompts is not supported; send one prompt per request", "prompt")
    raise _bad("'prompt' must be a string or a list of token ids", "prompt")


def _check_fields(doc: dict[str, Any]) -> None:
    for name in _INT_FIELDS:
        value = doc.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise _bad(f"'{name}' must be an integer", name)
    if doc.get("n") not in (None, 1):
        raise _bad("'n' greater than 1 is not supported with prefill/decode", "n")
    for name in ("max_tokens", "max_completion_tokens"):
        if doc.get(name) is not None and doc[name] < 1:
            raise _bad(f"'{name}' must be at least 1", name)
    if not isinstance(doc.get("stream", False), bool | None):
        raise _bad("'stream' must be a boolean", "stream")
    options = doc.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if not doc.get("stream"):
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")


def parse_request(api: Api, raw: bytes, limit: int) -> ClientRequest:
    """Parse and check a body; raises ClientError with the status the client should get."""
    if len(raw) > limit:
        raise ClientError(413, f"request body is {len(raw)} bytes; the limit is {limit} bytes")
    if not raw:
        raise _bad("the request has no body; send a JSON object")
    try:
        doc = orjson.loads(raw)  # orjson also rejects bytes that are not UTF-8
    except orjson.JSONDecodeError as error:
        raise _bad(f"the body is not valid UTF-8 JSON: {error}") from None
    if not isinstance(doc, dict):
        raise _bad("the body must be a JSON object")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    _check_prompt(api, doc)
    _check_fields(doc)
    try:
        parts = members(raw)
    except BodyError as error:  # orjson accepted it, so this is our scanner's gap: say so
        raise _bad(f"unsupported JSON layout: {error}") from None
    return ClientRequest(api, model, bool(doc.get("stream")), doc, parts)
