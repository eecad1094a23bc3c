"""Small building blocks shared by the pieces: type URLs, durations, addresses, listeners."""

from __future__ import annotations

from typing import Any

from extproc.config import Config, parse_host_port
from extproc.protocol.bodies import buffer_bytes

TYPED = "@type"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
    ".HttpConnectionManager"
)
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
# Envoy's default circuit breakers (1024 requests) would cap the requests in flight.
UNLIMITED = {
    "max_connections": 100000,
    "max_pending_requests": 100000,
    "max_requests": 100000,
    "max_retries": 1000,
}


def duration(seconds: float) -> str:
    """Envoy's JSON duration: decimal seconds, at most 9 decimals, never an exponent ("1e+06s"
    and "1e-05s", which `:g` writes, are refused)."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


def socket_address(listen: str) -> dict[str, Any]:
    """'unix:/path' → a pipe address; 'host:port' → a socket address."""
    if listen.startswith("unix:"):
        return {"pipe": {"path": listen.removeprefix("unix:"), "mode": 0o600}}
    host, port = parse_host_port(listen)
    return {"socket_address": {"address": host, "port_value": port}}


def router_filter() -> dict[str, Any]:
    return {"name": "envoy.filters.http.router", "typed_config": {TYPED: _ROUTER}}


def buffer_limit(cfg: Config) -> int:
    """Envoy's buffers hold the bodies the ext_proc builds, which are longer than the client's.

    The client's limit stays exactly limits.max_body_bytes: the ext_proc checks it on the
    client's body (413) before any leg leaves. Sizing Envoy's buffers to that limit instead
    would refuse a spliced body after P had already run.
    """
    return buffer_bytes(cfg.limits.max_body_bytes)


def listener(
    name: str, address: dict[str, Any], hcm: dict[str, Any], cfg: Config
) -> dict[str, Any]:
    """A listener with one HTTP connection manager (`hcm`: its fields besides @type)."""
    # Envoy's default on Linux is SO_REUSEPORT, which lets a second Envoy bind the same port
    # and silently take a share of its connections: off, a port in use fails the start.
    reuse = {"enable_reuse_port": False} if "socket_address" in address else {}
    return {
        "name": name,
        "address": address,
        **reuse,
        "per_connection_buffer_limit_bytes": buffer_limit(cfg),
        "filter_chains": [
            {"filters": [{"name": HCM_FILTER, "typed_config": {TYPED: HCM_TYPE, **hcm}}]}
        ],
    }
