"""Errors that end a client request, and their one mapping to OpenAI-style JSON.

Every request-ending error is a `RequestEnded`: an HTTP status, a message for the client, and
optionally `retry_after_s` (sent as Retry-After), `param` (the offending field) and `detail`,
for the log only: the engines' addresses and raw causes never reach the client. The
processor catches it at one place and answers with an ImmediateResponse carrying `body`
(`error_body`); `LegError`s also count in metrics and logs under their `label`.

RequestEnded
  ClientError            the request itself is wrong; nothing reaches an engine:
                         400 bad JSON, missing or ill-typed fields, `n` other than 1
                         (`request`); 404 unknown path, 405 method other than POST; 413 body
                         over limits.max_body_bytes, or a D body that would outgrow Envoy's
                         buffer once P's KV block list is spliced in (`processor`)
  LegError               a leg could not be run or failed; label "leg_error"
    PrefillFailed        P answered 4xx (passed on as is: P refused this request, its identity
                         is kept; the request counts as client_error, `is_client_error`); P
                         answered 5xx, or with a body that is not JSON or kv_transfer_params
                         that are unusable (502; its identity is dropped)
    PrefillUnreachable   Envoy could not connect to P, or P reset the connection (503,
                         retryable; P is marked unhealthy)
    PrefillTimeout       P did not answer within timeouts.prefill_s (504)
    ListenerUnreachable  the P leg could not connect to Envoy's own prefill listener (503,
                         retryable; P's health is left alone: P is not to blame)
    IdentityChanged      P's answer shows a new engine id: it restarted under a request
                         already dispatched to D with the old one (503, retryable)
    KvLost               P answered, D's 200 passed, then P restarted or went down before
                         its pushed KV could land: the started stream is reset (503 label)
    NoHealthyPrefill     no prefill endpoint is healthy for this request's model, and
                         dispatch.no_healthy_prefill is not decode_only (503, retryable)
    NoHealthyDecode      no decode endpoint is healthy for this request (503, retryable)
    KvMismatch           D failed a request whose P/D pair the probe found cannot exchange KV
                         (their connectors differ): 502 naming the mismatch, not D's bare 500
  Shed                   admission control: the pool is saturated for this request's
                         priority (429 + Retry-After; `extproc.scheduling.admission`); label "shed"

Errors that never reach a client live beside the code that raises them: `ConfigError`
(`extproc.config`; the CLI prints it and exits 2), `EnvoyError`
(`extproc.process.envoy_process`: no binary, Envoy failed to start or lacks a listener; exit 1)
and `BodyError` (`extproc.protocol.bodies`: a JSON layout the body scanner does not handle,
turned into a ClientError 400).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = [
    "ClientError",
    "IdentityChanged",
    "KvLost",
    "KvMismatch",
    "LegError",
    "ListenerUnreachable",
    "NoHealthyDecode",
    "NoHealthyPrefill",
    "PrefillBusy",
    "PrefillFailed",
    "PrefillTimeout",
    "PrefillUnreachable",
    "Shed",
    "error_body",
    "is_client_error",
]

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeout",
    413: "RequestTooLarge",
    429: "RateLimitError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


def is_client_error(status: int) -> bool:
    """An engine's 4xx caused by the client's request (unknown model, prompt too long, bad
    field, bad key): not a fault of the engines. 408 and 429 are the engine's load instead."""
    return 400 <= status < 500 and status not in (408, 429)


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The body vLLM and OpenAI use: {"error": {"message", "type", "param", "code"}}."""
    kind = _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


@dataclass
class RequestEnded(Exception):
    status: int
    message: str  # for the client: never an engine's address
    retry_after_s: int | None = None
    param: str | None = None
    detail: str | None = None  # for the operator's log only: which engine, the raw cause

    def __str__(self) -> str:
        detail = "" if self.detail is None else f" ({self.detail})"
        return f"{self.status} {self.message}{detail}"

    @property
    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


class ClientError(RequestEnded):
    """The client's request is invalid."""


class Shed(RequestEnded):
    """Admission control refused the request: the engines are saturated."""

    label = "shed"


class LegError(RequestEnded):
    """A P or D leg failed; the label names it in metrics and logs."""

    label = "leg_error"


class PrefillFailed(LegError):
    label = "prefill_error"


class PrefillBusy(PrefillFailed):
    """P answered 503 (overloaded or draining): another prefill endpoint may serve it."""


class PrefillUnreachable(LegError):
    label = "prefill_unreachable"


class PrefillTimeout(LegError):
    label = "prefill_timeout"


class ListenerUnreachable(LegError):
    label = "prefill_listener_unreachable"


class IdentityChanged(LegError):
    label = "identity_changed"


class KvLost(LegError):
    """The prefill engine that still owed a streamed answer its pushed KV restarted or went
    down after it answered (`extproc.request.pushed_kv`): the started stream is reset."""

    label = "kv_lost"


class NoHealthyPrefill(LegError):
    label = "no_healthy_prefill"


class NoHealthyDecode(LegError):
    label = "no_healthy_decode"


class KvMismatch(LegError):
    """D failed, and the probe found that this P/D pair cannot exchange KV (`kv_compat`)."""

    label = "kv_mismatch"
