"""vLLM-exact JSON and SSE shapes, request-id format and OpenAI error bodies.

vLLM serialises with pydantic `model_dump_json` (compact, declaration order); orjson
gives the same compact form for dicts built in that order. Stream chunks carry only the
fields vLLM sets (no `"usage":null`, `kv_transfer_params` only when there are some), and
the last chunk before [DONE] carries `system_fingerprint`. Key sets and order were checked
against real vLLM 0.32 by tests/real_vllm/test_contract.py.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import orjson

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"
# vLLM reports f"vllm-{version}-{8 hex}" (fixed per server process).
FINGERPRINT = f"vllm-0.33.0-{secrets.token_hex(4)}"


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_error(message: str, status: int) -> bytes:
    """An in-stream error event. vLLM writes it with json.dumps, spaces after separators
    (its other events are compact)."""
    return b"data: " + json.dumps(error_body(message, status)).encode() + b"\n\n"


def random_suffix() -> str:
    return secrets.token_hex(4)  # 8 hex chars, like f"{random_uuid():.8}"


def request_ids(base: str, chat: bool) -> tuple[str, str]:
    """(external id, engine-internal id) for one request, as vLLM 0.33 forms them."""
    if chat:
        external = f"chatcmpl-{base}"
        return external, f"{external}-{random_suffix()}"
    external = f"cmpl-{base}"
    return external, f"{external}-0-{random_suffix()}"


def error_body(
    message: str, status: int, param: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    fallback = "InternalServerError" if status >= 500 else "BadRequestError"
    kind = kind or {
        400: "BadRequestError",
        404: "NotFoundError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }.get(status, fallback)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def usage(
    prompt: int, completion: int, details: bool = True, cached: int | None = None
) -> dict[str, Any]:
    """`cached`: prompt tokens whose KV was not computed (local hits and transferred), given
    only with --enable-prompt-tokens-details; vLLM reports them only when there are some."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    cached_details = {"cached_tokens": cached} if cached else None
    if details:  # non-streamed answers; the stream's usage chunk has the counts (and details)
        body["prompt_tokens_details"] = cached_details
        body["completion_tokens_details"] = None
    elif cached_details is not None:
        body["prompt_tokens_details"] = cached_details
    return body


def _finish(
    chunk: dict[str, Any], kv_params: dict[str, Any] | None, fingerprint: bool
) -> dict[str, Any]:
    """The last content chunk: kv_transfer_params only when set, and the fingerprint when no
    usage chunk follows (vLLM puts it on the stream's last chunk)."""
    if kv_params is not None:
        chunk["kv_transfer_params"] = kv_params
    if fingerprint:
        chunk["system_fingerprint"] = FINGERPRINT
    return chunk


# -- /v1/completions ---------------------------------------------------------------------
def completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    kv_params: dict[str, Any] | None,
    cached: int | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage(prompt_tokens, completion_tokens, cached=cached),
        "kv_transfer_params": kv_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    kv_params: dict[str, Any] | None = None,
    last: bool = False,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
    }
    return _finish(chunk, kv_params, last) if finish is not None else chunk


def completion_usage_chunk(
    rid: str,
    created: int,
    model: str,
    prompt: int,
    completion_tokens: int,
    cached: int | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt, completion_tokens, details=False, cached=cached),
        "system_fingerprint": FINGERPRINT,
    }


# -- /v1/chat/completions ----------------------------------------------------------------
def chat_completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    kv_params: dict[str, Any] | None,
    cached: int | None = None,
) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage(prompt_tokens, completion_tokens, cached=cached),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": kv_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_role_chunk(rid: str, created: int, model: str) -> dict[str, Any]:
    """The first chunk of a chat stream: the role, and the (unrequested) prompt fields."""
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
        "prompt_token_ids": None,
        "prompt_text": None,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish: str | None,
    final: bool = False,
    kv_params: dict[str, Any] | None = None,
    last: bool = False,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if final:
        choice["stop_reason"] = None
    choice["token_ids"] = None
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return _finish(chunk, kv_params, last) if final else chunk


def chat_usage_chunk(
    rid: str,
    created: int,
    model: str,
    prompt: int,
    completion_tokens: int,
    cached: int | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt, completion_tokens, details=False, cached=cached),
        "system_fingerprint": FINGERPRINT,
    }
