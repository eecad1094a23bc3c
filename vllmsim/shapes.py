"""vLLM-exact JSON and SSE shapes, request-id format and OpenAI error bodies.

vLLM serialises with pydantic `model_dump_json` (compact, declaration order); orjson
gives the same compact form for dicts built in that order. Completions chunks are
dumped with exclude_unset=False (so `"usage":null` appears), chat chunks with
exclude_unset=True (so unset fields are absent).
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def random_suffix() -> str:
    return secrets.token_hex(4)  # 8 hex chars, like f"{random_uuid():.8}"


def request_ids(base: str, chat: bool) -> tuple[str, str]:
    """(external id, engine-internal id) for one request, per vLLM 0.33 (spec §2)."""
    if chat:
        external = f"chatcmpl-{base}"
        return external, f"{external}-{random_suffix()}"
    external = f"cmpl-{base}"
    return external, f"{external}-0-{random_suffix()}"


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError" if status >= 500
                                                else "BadRequestError")  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def usage(prompt: int, completion: int, with_details: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                            "completion_tokens": completion}  # fmt: skip
    if with_details:
        body["prompt_tokens_details"] = None
    return body


# -- /v1/completions ---------------------------------------------------------------------
def completion(rid: str, created: int, model: str, text: str, finish: str | None,
               prompt_tokens: int, completion_tokens: int,
               kv_params: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                     "stop_reason": None, "prompt_logprobs": None}],
        "usage": usage(prompt_tokens, completion_tokens),
        "kv_transfer_params": kv_params,
    }  # fmt: skip


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None,
                     kv_params: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                     "stop_reason": None}],
        "usage": None,
    }  # fmt: skip
    if finish is not None:
        chunk["kv_transfer_params"] = kv_params
    return chunk


def completion_usage_chunk(rid: str, created: int, model: str, prompt: int,
                           completion_tokens: int) -> dict[str, Any]:  # fmt: skip
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [], "usage": usage(prompt, completion_tokens)}  # fmt: skip


# -- /v1/chat/completions ----------------------------------------------------------------
def chat_completion(rid: str, created: int, model: str, text: str, finish: str | None,
                    prompt_tokens: int, completion_tokens: int,
                    kv_params: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    message = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
               "audio": None, "function_call": None, "tool_calls": [],
               "reasoning_content": None}  # fmt: skip
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                     "stop_reason": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": usage(prompt_tokens, completion_tokens),
        "prompt_logprobs": None,
        "kv_transfer_params": kv_params,
    }  # fmt: skip


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any], finish: str | None,
               final: bool = False,
               kv_params: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish}  # fmt: skip
    if final:
        choice["stop_reason"] = None
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": [choice]}  # fmt: skip
    if final:
        chunk["kv_transfer_params"] = kv_params
    return chunk


def chat_usage_chunk(rid: str, created: int, model: str, prompt: int,
                     completion_tokens: int) -> dict[str, Any]:  # fmt: skip
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage(prompt, completion_tokens, with_details=False)}
