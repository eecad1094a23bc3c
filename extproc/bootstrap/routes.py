"""The ingress routes: the OpenAI paths through the ext_proc, the engines' read-only endpoints
without it, and what every other route needs."""

from __future__ import annotations

from typing import Any

from extproc.bootstrap.common import TYPED, buffer_limit, duration
from extproc.bootstrap.ext_proc_filter import EXT_PROC_PER_ROUTE, streamed_body_route
from extproc.config import Config
from extproc.headers import SIDECAR_HEADERS
from extproc.request.parse import PASSTHROUGH, PATHS


def without_extproc() -> dict[str, Any]:
    """What every route that skips the ext_proc needs: a client's copies of the sidecar's
    headers (the destination, the data-parallel rank) must not steer it. A new dict per call:
    rendered pieces never share (and so never co-mutate) state."""
    return {
        "request_headers_to_remove": list(SIDECAR_HEADERS),
        "typed_per_filter_config": {
            "envoy.filters.http.ext_proc": {TYPED: EXT_PROC_PER_ROUTE, "disabled": True}
        },
    }


def _decode_route(cfg: Config) -> dict[str, Any]:
    return {
        "cluster": "decode_pool",
        "timeout": "0s",  # generations stream for minutes; the ext_proc bounds the P leg
        "idle_timeout": duration(cfg.timeouts.kv_wait_s),  # a D waiting for KV forever
        # a refused connection is retried on the next host of the ext_proc's list
        "retry_policy": {"retry_on": "connect-failure", "num_retries": 1},
    }


def llm_routes(cfg: Config) -> list[dict[str, Any]]:
    """The OpenAI paths: through the ext_proc, the body streamed to it, to decode_pool."""
    return [
        {
            "match": {"path": path},
            "route": _decode_route(cfg),
            "request_body_buffer_limit": buffer_limit(cfg),
            "typed_per_filter_config": {"envoy.filters.http.ext_proc": streamed_body_route()},
        }
        for path in sorted(PATHS)
    ]


def _method(method: str) -> dict[str, Any]:
    return {"name": ":method", "string_match": {"exact": method}}


def passthrough_routes() -> list[dict[str, Any]]:
    """The engines' read-only endpoints, by exact path and method, without the ext_proc."""
    return [
        {
            "match": {"path": path, "headers": [_method(method)]},
            "route": {"cluster": "decode_pool", "timeout": "60s"},
            **without_extproc(),
        }
        for path, method in PASSTHROUGH.items()
    ]


def catch_all_route(cfg: Config) -> dict[str, Any]:
    """Everything else goes through the ext_proc too, which answers 404/405 in JSON."""
    return {"match": {"prefix": "/"}, "route": _decode_route(cfg)}
