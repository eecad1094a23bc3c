"""Why an engine did not answer, in the few words an operator reads in a log line."""

from __future__ import annotations

import aiohttp

__all__ = ["failure_reason"]


def failure_reason(error: BaseException) -> str:
    """'connection refused', 'timeout', 'HTTP 503', or the error's own words."""
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, aiohttp.ClientResponseError):
        return f"HTTP {error.status}"
    if isinstance(error, aiohttp.ClientConnectorError):
        cause = error.os_error
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect: {cause.strerror or cause}"
    if isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return "connection closed by the engine"
    return str(error) or type(error).__name__
