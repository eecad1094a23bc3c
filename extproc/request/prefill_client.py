"""The P leg's HTTP client: one POST (`PrefillCall`) to a prefill engine, along one of two routes.

`ThroughListener` goes through Envoy's loopback prefill listener, which keeps connection
pooling, stats and override_host's check that the endpoint is a member of prefill_pool. Envoy
marks its own local replies (connect failure, reset) with `LOCAL_REPLY_HEADER`, so that "P is
unreachable" (503, retryable, mark unhealthy) can be told from "P answered 503".

`ToEngine` goes straight to the engine, for where no prefill listener exists (an endpoint
picker behind someone else's gateway) or where its latency and CPU matter more. It gives up
Envoy's pooling, retries, per-cluster stats and the pool check (the ext_proc's own pool is the
only check then). Its connections are kept alive per engine, shorter than the engines' own
keep-alive (vLLM closes idle connections after 5 s), so that a request never goes out on a
connection the engine is closing.

Both write HTTP/1.1 over `extproc.request.http1`'s kept-alive connections, not aiohttp: the P
leg is on every request's path, and there aiohttp cost more CPU than the request's planning.

`PrefillPaths` chooses the route per leg (dispatch.prefill_leg); `TrackedPrefillSender`
keeps each prefill endpoint's `queued_tokens` exact around the legs it sends. Each leg carries
the config snapshot of whoever sent it (`PrefillCall.config`: the request's, or the probe's),
and everything here that depends on settings reads that one: a reload never reaches a leg.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from extproc.errors import (
    LegError,
    ListenerUnreachable,
    PrefillBusy,
    PrefillFailed,
    PrefillTimeout,
    PrefillUnreachable,
)
from extproc.headers import DESTINATION_HEADER, LOCAL_REPLY_HEADER
from extproc.protocol.bodies import Spliced
from extproc.request.client_key import client_key_checked_here
from extproc.request.http1 import BrokenConnection, Connections, Destination, NotConnected, head
from extproc.scheduling.decision import estimate_tokens

if TYPE_CHECKING:
    from extproc.config import Config
    from extproc.scheduling.pool import EndpointState

__all__ = [
    "PrefillCall",
    "PrefillClient",
    "PrefillPaths",
    "PrefillResult",
    "PrefillSender",
    "ThroughListener",
    "ToEngine",
    "TrackedPrefillSender",
    "p_leg_key",
    "prefill_error",
]

# Envoy response flags that mean the upstream was never reached or dropped the connection.
_UNREACHABLE_FLAGS = {"UF", "UH", "URX", "UO", "UC", "UR", "NR", "LR"}
_KEEPALIVE_S = 4.0  # straight to the engine: below vLLM's (uvicorn's) 5 s idle close


@dataclass(slots=True)  # not frozen: built per P leg, and a frozen init costs ~7x (~1.5 µs)
class PrefillCall:
    """One P leg: the prefill endpoint ("host:port"), the API path, P's body, the config
    snapshot it is sent under (its route, the engines' key, its token estimate), and the
    headers it carries beyond the route's own (the client's forwarded ones, or the probe's
    key)."""

    endpoint: str
    path: str
    body: bytes | Spliced  # P's (as its pieces when spliced from a client's body)
    request_id: str
    timeout_s: float
    config: Config
    headers: Mapping[str, str] | None = None


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
            503,
            f"the prefill engine is unreachable ({flags}); retry",
            retry_after_s=1,
            detail=f"prefill {endpoint}",
        )
    message = f"the prefill engine answered {status}"
    try:
        detail = orjson.loads(body)["error"]
        # OpenAI-style {"error": {"message": ...}}, or vLLM's 401 {"error": "Unauthorized"}
        message += f": {detail if isinstance(detail, str) else detail['message']}"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    # 4xx from P means the request is bad for the engine: pass it on; 5xx becomes 502.
    where = f"prefill {endpoint}"
    if status == 503:
        return PrefillBusy(502, message, detail=where)  # serial dispatch may retry it elsewhere
    return PrefillFailed(status if 400 <= status < 500 else 502, message, detail=where)


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
        raise PrefillFailed(
            502, "the prefill engine sent a non-JSON body", detail=f"prefill {endpoint}"
        ) from None
    return PrefillResult(status, params, started, elapsed)


class Route(Protocol):
    """What differs between the two routes: where the POST goes, what it carries, who is
    blamed when no connection is had."""

    connect_timeout_s: float
    keepalive_s: float  # how long an idle connection is kept for the next leg
    answer_headers: tuple[str, ...]  # the answer's headers `flags` reads

    def destination(self, call: PrefillCall) -> Destination: ...
    def host(self, call: PrefillCall) -> str: ...
    def headers(self, call: PrefillCall) -> dict[str, str]: ...
    def flags(self, headers: Mapping[str, str]) -> str | None: ...
    # `error` None: no connection within connect_timeout_s
    def not_connected(self, call: PrefillCall, error: OSError | None) -> LegError: ...
    def broke(self, call: PrefillCall, error: Exception) -> LegError: ...


class ThroughListener:
    """Envoy's prefill listener ("unix:/path" or "host:port"), which routes by the
    destination header and passes the other headers on to P (the key of `p_leg_key` too).
    """

    keepalive_s: float = 60.0  # Envoy keeps its listener's idle connections for an hour
    answer_headers: tuple[str, ...] = (LOCAL_REPLY_HEADER,)

    def __init__(self, listener: str, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        unix = listener.startswith("unix:")
        self._host = "prefill" if unix else listener
        path = listener.removeprefix("unix:") if unix else None
        self._destination = Destination(listener, path)

    def destination(self, call: PrefillCall) -> Destination:
        return self._destination

    def host(self, call: PrefillCall) -> str:
        return self._host

    def headers(self, call: PrefillCall) -> dict[str, str]:
        return {
            "content-type": "application/json",
            DESTINATION_HEADER: call.endpoint,
            "x-request-id": call.request_id,
            **p_leg_key(call.config),
            **(call.headers or {}),
        }

    def flags(self, headers: Mapping[str, str]) -> str | None:
        return headers.get(LOCAL_REPLY_HEADER)

    # Not getting a connection to Envoy's own listener is not P's fault: ListenerUnreachable
    # leaves P's health alone.
    def not_connected(self, call: PrefillCall, error: OSError | None) -> LegError:
        if error is None:
            why, detail = f"did not accept a connection within {self.connect_timeout_s:g} s", None
        else:
            why, detail = f"is unreachable ({_os_reason(error)})", str(error)
        return ListenerUnreachable(
            503, f"the prefill listener {why}; retry", retry_after_s=1, detail=detail
        )

    def broke(self, call: PrefillCall, error: Exception) -> LegError:
        return PrefillUnreachable(
            503,
            "the prefill leg's connection broke; retry",
            retry_after_s=1,
            detail=f"prefill {call.endpoint}: {error}",
        )


def p_leg_key(config: Config) -> dict[str, str]:
    """The engines' key (engines.api_key_file) for a P leg, on either route, only where the
    client's own key is not forwarded: otherwise P sees the key D sees (a client without one
    gets the engines' 401 from both legs, and nothing is computed). Where it is sent, the
    ext_proc checks the client's key itself first (`extproc.request.client_key`)."""
    return config.engines.auth_headers if client_key_checked_here(config) else {}


class ToEngine:
    """The prefill engine itself, one kept-alive connection pool per engine. The leg carries
    `p_leg_key`; a client key forwarded by dispatch.forward_headers wins over it."""

    keepalive_s: float = _KEEPALIVE_S
    answer_headers: tuple[str, ...] = ()

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s

    def destination(self, call: PrefillCall) -> Destination:
        return Destination(call.endpoint)

    def host(self, call: PrefillCall) -> str:
        return call.endpoint

    def headers(self, call: PrefillCall) -> dict[str, str]:
        return {
            "content-type": "application/json",
            **p_leg_key(call.config),
            **(call.headers or {}),
            "x-request-id": call.request_id,
        }

    def flags(self, headers: Mapping[str, str]) -> None:
        return None  # no Envoy in between: every answer is the engine's

    def not_connected(self, call: PrefillCall, error: OSError | None) -> LegError:
        if error is None:
            return _unreachable(call, f"no connection within {self.connect_timeout_s:g} s")
        return _unreachable(call, _os_reason(error), str(error))

    def broke(self, call: PrefillCall, error: Exception) -> LegError:
        return _unreachable(call, "the connection broke", str(error))


def _os_reason(error: OSError) -> str:
    """The OS's reason alone: asyncio's own text names the address it could not reach."""
    return os.strerror(error.errno).lower() if error.errno else "connection refused"


def _unreachable(call: PrefillCall, why: str, cause: str | None = None) -> PrefillUnreachable:
    detail = f"prefill {call.endpoint}" + ("" if cause is None else f": {cause}")
    return PrefillUnreachable(
        503, f"the prefill engine is unreachable ({why}); retry", retry_after_s=1, detail=detail
    )


class PrefillClient:
    """Sends P legs along `route`; its connections open on first use."""

    def __init__(self, route: Route) -> None:
        self._route = route
        self._connections: Connections | None = None

    @property
    def connections(self) -> Connections:
        if self._connections is None:
            route = self._route
            self._connections = Connections(route.keepalive_s, route.answer_headers)
        return self._connections

    async def close(self) -> None:
        if self._connections is not None:
            self._connections.close()
            self._connections = None

    async def send(self, call: PrefillCall) -> PrefillResult:
        """POST P's body; PrefillResult on 2xx, else a LegError subclass is raised."""
        route, connections = self._route, self.connections
        started = time.perf_counter()
        try:
            request = head(call.path, route.host(call), route.headers(call), len(call.body))
        except ValueError as error:  # Envoy forwards no such header: a client's own, if any
            raise PrefillFailed(400, f"the request cannot be sent on: {error}") from None
        try:
            async with asyncio.timeout(call.timeout_s):
                answer = await connections.post(
                    route.destination(call), request, route.connect_timeout_s, call.body
                )
        except NotConnected as error:
            raise route.not_connected(call, error.error) from None
        except TimeoutError:
            raise PrefillTimeout(
                504,
                f"the prefill engine did not answer within {call.timeout_s:g} s",
                detail=f"prefill {call.endpoint}",
            ) from None
        except BrokenConnection as error:
            raise route.broke(call, error) from None
        flags = route.flags(answer.headers)
        return prefill_result(answer.status, flags, answer.body, call.endpoint, started)


class PrefillSender(Protocol):
    """What sends a P leg: a PrefillClient, PrefillPaths, or a wrapper of one (dispatch and
    the identity probe need only this)."""

    def send(self, call: PrefillCall) -> Coroutine[Any, Any, PrefillResult]: ...


class PrefillPaths:
    """Each P leg's route: dispatch.prefill_leg of the leg's own config ("listener" or
    "direct"), or always the engine where no prefill listener exists (`no_listener`: an
    endpoint picker). Each client opens its connections on first use only."""

    def __init__(self, listener: PrefillClient, direct: PrefillClient, no_listener: bool) -> None:
        self._clients = {"listener": listener, "direct": direct}
        self._no_listener = no_listener

    def send(self, call: PrefillCall) -> Coroutine[Any, Any, PrefillResult]:
        route = "direct" if self._no_listener else call.config.dispatch.prefill_leg
        return self._clients[route].send(call)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


class TrackedPrefillSender:
    """A PrefillSender that keeps each prefill endpoint's `queued_tokens` (the prompt tokens
    of the P legs in flight there, estimated from the bodies) exact, for the decode-only
    decision (`extproc.scheduling.decision`), at the leg's decision.bytes_per_token."""

    def __init__(self, inner: PrefillSender, state: Callable[[str], EndpointState | None]) -> None:
        self._inner = inner
        self._state = state  # address → its state in the prefill pool (None: not a member)

    async def send(self, call: PrefillCall) -> PrefillResult:
        tokens = estimate_tokens(len(call.body), call.config.decision.bytes_per_token)
        state = self._state(call.endpoint)
        if state is not None:
            state.queued_tokens += tokens
            state.publish()
        try:
            return await self._inner.send(call)
        finally:
            if state is not None:
                state.queued_tokens -= tokens
                state.publish()
