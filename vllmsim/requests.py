"""Parse and validate an OpenAI completion/chat body into a `ParsedRequest`.

Raises `ApiError` with vLLM's status and message for bad input; decides the KV mode
from `kv_transfer_params` and this engine's connector exactly as vLLM 0.33 does.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from vllmsim.chat_template import ChatTemplateError
from vllmsim.config import SimConfig
from vllmsim.engine import KVMode
from vllmsim.nixl.params import PULL_REQUIRED, PUSH_REQUIRED, missing_keys
from vllmsim.prefix_cache import NO_SCOPE, HashScope
from vllmsim.tokens import TokenCounter

log = logging.getLogger(__name__)


# vLLM's message when its EngineCore process has died (EngineDeadError).
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class ApiError(Exception):
    """An error answer. `kind` overrides the type derived from the status; `in_stream` marks an
    error vLLM meets while generating, which a streamed request gets after its 200 as an error
    event (validation errors come before the stream and keep their status)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,
        in_stream: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.in_stream = in_stream


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    mode: KVMode
    kv_params: dict[str, Any] | None
    scope: HashScope = NO_SCOPE  # the adapter it names and its cache_salt

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def base_request_id(headers: Any, body: dict[str, Any]) -> str:
    """The `X` of cmpl-X: header wins, then body `request_id`, then a fresh uuid."""
    header = headers.get("X-Request-Id")
    if header:
        return str(header)
    if isinstance(body.get("request_id"), str) and body["request_id"]:
        return str(body["request_id"])
    return uuid.uuid4().hex


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name}: Input should be a valid integer")
    return value


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: Input should be a valid boolean")
    return value


def prompt_ids(body: dict[str, Any], chat: bool, tokens: TokenCounter) -> list[int]:
    """The prompt's token ids (their count is usage.prompt_tokens; they fill the KV)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages: Field required")
        if not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages: each message must be an object")
        kwargs = body.get("chat_template_kwargs")
        try:
            return tokens.chat_ids(
                messages,
                _bool_field(body, "add_generation_prompt", True),
                _bool_field(body, "add_special_tokens", False),
                kwargs if isinstance(kwargs, dict) else None,
            )
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc)) from exc
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokens.encode(prompt, _bool_field(body, "add_special_tokens", True))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt  # token ids count exactly
    if prompt is None:
        raise ApiError(400, "prompt: Field required")
    raise ApiError(400, "prompt must be a string, a list of token ids, or a one-element list")


def _max_tokens(body: dict[str, Any], chat: bool, prompt_tokens: int, max_len: int) -> int:
    value = _int_field(body, "max_completion_tokens") if chat else None
    if value is None:
        value = _int_field(body, "max_tokens")
    if value is None:
        value = max_len - prompt_tokens if chat else 16  # vLLM's defaults
    if value < 1:
        raise ApiError(
            400,
            f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})",
            "max_tokens",
        )
    if prompt_tokens + value > max_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_len} tokens. However, "
            f"you requested {prompt_tokens + value} tokens ({prompt_tokens} in the "
            f"messages, {value} in the completion). Please reduce the length of "
            "the messages or completion.",
        )
    min_tokens = _int_field(body, "min_tokens") or 0
    if min_tokens < 0 or min_tokens > value:
        raise ApiError(
            400, f"min_tokens must be less than or equal to max_tokens={value}, got {min_tokens}."
        )
    return value


def kv_mode(cfg: SimConfig, params: Any) -> KVMode:
    """How this request meets the KV connector (which `KVMode`)."""
    if cfg.kv is None or not isinstance(params, dict):
        return KVMode.LOCAL  # no connector: kv_transfer_params are ignored
    if params.get("do_remote_decode"):
        return KVMode.PREFILL
    if not params.get("do_remote_prefill"):
        return KVMode.LOCAL
    if cfg.kv.transfer_mode == "push":
        if missing := missing_keys(params, PUSH_REQUIRED):
            # vLLM raises KeyError in the scheduler and its EngineCore dies (the request gets
            # vLLM's engine-dead error); the simulator stays up and fails only this request.
            log.error("push kv_transfer_params missing %s: real vLLM would crash here", missing)
            raise ApiError(500, ENGINE_DEAD, in_stream=True)
        return KVMode.PUSH
    if missing := missing_keys(params, PULL_REQUIRED):
        log.warning("Got invalid KVTransferParams (missing %s); recomputing locally", missing)
        return KVMode.RECOMPUTE
    return KVMode.PULL


def _summarised(value: Any) -> str:
    """How vLLM shows the offending input in a validation error: containers by their size."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return value if isinstance(value, str) else str(value)


def validation_error(
    kind: str, loc: str, msg: str, value: Any, ctx: dict[str, Any] | None = None
) -> ApiError:
    """A request-model validation error worded as vLLM words pydantic's (400, "Bad Request")."""
    detail: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": _summarised(value)}
    if ctx is not None:
        detail["ctx"] = ctx
    return ApiError(400, f"1 validation error:\n  {detail!r}", loc, "Bad Request")


def invalid_json(raw: bytes) -> ApiError:
    """FastAPI's JSON decode error: where and why Python's json parser stopped."""
    try:
        json.loads(raw)
    except json.JSONDecodeError as exc:
        return validation_error(
            "json_invalid", f"body.{exc.pos}", "JSON decode error", {}, {"error": exc.msg}
        )
    except ValueError:  # not UTF-8/16/32 at all
        pass
    return validation_error("json_invalid", "body", "JSON decode error", {})


def _check_kv_params_type(params: Any) -> None:
    """vLLM's request model types kv_transfer_params as an object."""
    if params is not None and not isinstance(params, dict):
        raise validation_error(
            "dict_type", "body.kv_transfer_params", "Input should be a valid dictionary", params
        )


def parse(cfg: SimConfig, tokens: TokenCounter, body: Any, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    _check_kv_params_type(body.get("kv_transfer_params"))
    model = body.get("model") or cfg.served_model_names[0]
    if model not in cfg.served_model_names and model not in cfg.lora_modules:
        aliases = ", ".join(cfg.served_model_names)
        raise ApiError(
            404, f"The model `{model}` does not exist. Valid aliases: {aliases}.", "model"
        )
    scope = _hash_scope(cfg, model, body.get("cache_salt"))
    ids = prompt_ids(body, chat, tokens)
    max_tokens = _max_tokens(body, chat, len(ids), cfg.cost.max_model_len)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: Input should be a valid boolean")
    opts = body.get("stream_options") or {}
    if opts and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    params = body.get("kv_transfer_params")
    return ParsedRequest(
        chat,
        str(model),
        ids,
        max_tokens,
        stream,
        bool(isinstance(opts, dict) and opts.get("include_usage")),
        kv_mode(cfg, params),
        params if isinstance(params, dict) else None,
        scope,
    )


def _hash_scope(cfg: SimConfig, model: str, salt: Any) -> HashScope:
    """What the request's block hashes cover besides its tokens: the adapter its model names
    (vLLM's LoRA request), and its cache_salt, which vLLM requires to be a non-empty string."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.")
    if model in cfg.lora_modules:
        return HashScope(model, cfg.lora_modules.index(model) + 1, salt)
    return HashScope(cache_salt=salt)
