"""Errors that end a client request, and their one mapping to OpenAI-style JSON.

ClientError              4xx: the request itself is wrong; nothing reaches an engine
LegError                 a leg failed; status says what the client gets
  PrefillFailed          P answered 4xx/5xx (P's status, or 502)
  PrefillUnreachable     P refused the connection or reset it (503, retryable)
  PrefillTimeout         P did not answer within timeouts.prefill_s (504)
  ListenerUnreachable    the P leg could not connect to Envoy's prefill listener (503,
                         retryable; P itself is not to blame)
  IdentityChanged        P restarted under a request already dispatched (503, retryable)
  NoHealthyPrefill       every prefill endpoint is down (503, retryable)
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

__all__ = [
    "ClientError",
    "IdentityChanged",
    "LegError",
    "ListenerUnreachable",
    "NoHealthyDecode",
    "NoHealthyPrefill",
    "PrefillFailed",
    "PrefillTimeout",
    "PrefillUnreachable",
    "error_body",
]

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The body vLLM and OpenAI use: {"error": {"message", "type", "param", "code"}}."""
    kind = _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


@dataclass
class RequestEnded(Exception):
    status: int
    message: str
    retry_after_s: int | None = None
    param: str | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.message}"

    @property
    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param)


class ClientError(RequestEnded):
    """The client's request is invalid."""


class LegError(RequestEnded):
    """A P or D leg failed; the label names it in metrics and logs."""

    label = "leg_error"


class PrefillFailed(LegError):
    label = "prefill_error"


class PrefillUnreachable(LegError):
    label = "prefill_unreachable"


class PrefillTimeout(LegError):
    label = "prefill_timeout"


class ListenerUnreachable(LegError):
    label = "prefill_listener_unreachable"


class IdentityChanged(LegError):
    label = "identity_changed"


class NoHealthyPrefill(LegError):
    label = "no_healthy_prefill"


class NoHealthyDecode(LegError):
    label = "no_healthy_decode"
