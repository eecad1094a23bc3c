"""The P leg: a POST through Envoy's loopback prefill listener, bounded by a timeout; and the
choice between that path and the one straight to the engine (`extproc.request.prefill_direct`).

Going through Envoy keeps connection pooling, stats and the override_host pool check for
prefill too. Envoy marks its own local replies (connect failure, reset) with
`LOCAL_REPLY_HEADER` so that "P is unreachable" (503, retryable, mark unhealthy) can be told
from "P answered 503".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

from extproc.errors import (
    ListenerUnreachable,
    PrefillBusy,
    PrefillFailed,
    PrefillTimeout,
    PrefillUnreachable,
)
from extproc.headers import DESTINATION_HEADER, LOCAL_REPLY_HEADER

__all__ = [
    "PrefillClient",
    "PrefillPaths",
    "PrefillResult",
    "PrefillSender",
    "prefill_error",
]

# Envoy response flags that mean the upstream was never reached or dropped the connection.
_UNREACHABLE_FLAGS = {"UF", "UH", "URX", "UO", "UC", "UR", "NR", "LR"}


@dataclass(frozen=True, slots=True)
class PrefillResult:
    status: int
    kv_transfer_params: Any
    started_at: float  # perf_counter when the request left the sidecar
    elapsed_s: float


def prefill_error(status: int, flags: str | None, body: bytes, endpoint: str) -> Exception:
    """The error for a non-2xx answer of P (`flags`: Envoy's response flags, when it replied)."""
    if flags is not None and _UNREACHABLE_FLAGS & set(flags.split(",")):
        return PrefillUnreachable(
            503, f"prefill endpoint {endpoint} is unreachable ({flags}); retry", retry_after_s=1
        )
    message = f"prefill endpoint {endpoint} answered {status}"
    try:
        detail = orjson.loads(body)["error"]
        # OpenAI-style {"error": {"message": ...}}, or vLLM's 401 {"error": "Unauthorized"}
        message += f": {detail if isinstance(detail, str) else detail['message']}"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    # 4xx from P means the request is bad for the engine: pass it on; 5xx becomes 502.
    if status == 503:
        return PrefillBusy(502, message)  # serial dispatch may retry it elsewhere
    return PrefillFailed(status if 400 <= status < 500 else 502, message)


def prefill_result(
    status: int, flags: str | None, payload: bytes, endpoint: str, started: float
) -> PrefillResult:
    """P's answer as a result (its kv_transfer_params), or the LegError it means."""
    elapsed = time.perf_counter() - started
    if status >= 300:
        raise prefill_error(status, flags, payload, endpoint)
    try:
        params = orjson.loads(payload).get("kv_transfer_params")
    except (orjson.JSONDecodeError, AttributeError):
        raise PrefillFailed(502, f"prefill endpoint {endpoint} sent a non-JSON body") from None
    return PrefillResult(status, params, started, elapsed)


class PrefillClient:
    """Sends P legs to Envoy's prefill listener ("unix:/path" or "host:port")."""

    def __init__(self, listener: str, connect_timeout_s: float) -> None:
        self._listener = listener
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            if self._listener.startswith("unix:"):
                connector: aiohttp.BaseConnector = aiohttp.UnixConnector(
                    path=self._listener.removeprefix("unix:"), limit=0
                )
                self._base = "http://prefill"
            else:
                connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
                self._base = f"http://{self._listener}"
            self._session = aiohttp.ClientSession(
                connector=connector, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self,
        endpoint: str,
        path: str,
        body: bytes,
        request_id: str,
        timeout_s: float,
        extra_headers: dict[str, str] | None = None,
    ) -> PrefillResult:
        """POST the P body; PrefillResult on 2xx, else a LegError subclass is raised."""
        headers = {
            "content-type": "application/json",
            DESTINATION_HEADER: endpoint,
            "x-request-id": request_id,
            **(extra_headers or {}),
        }
        session = self.session
        started = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)
        try:
            async with session.post(
                self._base + path, data=body, headers=headers, timeout=timeout
            ) as response:
                payload = await response.read()
                status, flags = response.status, response.headers.get(LOCAL_REPLY_HEADER)
        # Not getting a connection to Envoy's own listener is not P's fault: ListenerUnreachable
        # leaves P's health alone. ConnectionTimeoutError is a TimeoutError too: it comes first.
        except aiohttp.ConnectionTimeoutError:
            raise ListenerUnreachable(
                503,
                f"the prefill listener did not accept a connection within "
                f"{self._connect_timeout_s:g} s; retry",
                retry_after_s=1,
            ) from None
        except aiohttp.ClientConnectorError as error:
            raise ListenerUnreachable(
                503,
                f"the prefill listener is unreachable ({error.strerror}); retry",
                retry_after_s=1,
            ) from None
        except TimeoutError:
            raise PrefillTimeout(
                504, f"prefill endpoint {endpoint} did not answer within {timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as error:
            raise PrefillUnreachable(
                503, f"the prefill leg's connection broke ({error}); retry", retry_after_s=1
            ) from None
        return prefill_result(status, flags, payload, endpoint, started)


class PrefillSender(Protocol):
    """What sends a P leg: PrefillClient (through the listener), DirectPrefillClient, or a
    wrapper of one (dispatch needs only this)."""

    def send(
        self,
        endpoint: str,
        path: str,
        body: bytes,
        request_id: str,
        timeout_s: float,
        extra_headers: dict[str, str] | None = None,
    ) -> Coroutine[Any, Any, PrefillResult]: ...


class PrefillConnections(PrefillSender, Protocol):
    """A PrefillSender that owns its connections."""

    async def close(self) -> None: ...


class PrefillPaths:
    """The P leg's path for each request: dispatch.prefill_leg, read live (a reload switches
    it). Each client opens its connections on first use only."""

    def __init__(
        self, listener: PrefillConnections, direct: PrefillConnections, path: Callable[[], str]
    ) -> None:
        self._clients = {"listener": listener, "direct": direct}
        self._path = path

    def send(
        self,
        endpoint: str,
        path: str,
        body: bytes,
        request_id: str,
        timeout_s: float,
        extra_headers: dict[str, str] | None = None,
    ) -> Coroutine[Any, Any, PrefillResult]:
        client = self._clients[self._path()]
        return client.send(endpoint, path, body, request_id, timeout_s, extra_headers)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
