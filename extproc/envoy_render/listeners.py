"""The two listeners: the ingress (clients) and the prefill listener (the ext_proc's P legs)."""

from __future__ import annotations

from typing import Any

from extproc.config import Config
from extproc.envoy_render.common import buffer_limit, listener, router_filter, socket_address
from extproc.envoy_render.local_replies import FLAG_LOCAL_REPLIES, ingress_local_replies

# Envoy does not normalise paths by default, and routes match the path as sent: without these a
# target such as /health/../v1/completions or /v1/models%2F..%2Fcompletions would take a route
# without the ext_proc. Escaped slashes (%2F, %5C) are refused rather than redirected: no API
# path has one, and a redirect would have clients re-send a POST body to a path they never
# wrote. Envoy answers 400 (path_normalization_failed), which the local-reply mapper words.
PATH_HANDLING = {
    "normalize_path": True,
    "merge_slashes": True,
    "path_with_escaped_slashes_action": "REJECT_REQUEST",
}


def ingress_hcm_settings(cfg: Config) -> dict[str, Any]:
    """What the ingress connection manager needs besides its routes and filters."""
    return {
        "delayed_close_timeout": "0s",  # resets reach HTTP/1.1 clients at once
        **PATH_HANDLING,
        "local_reply_config": ingress_local_replies(cfg),
    }


def ingress_listener(
    cfg: Config,
    hcm_settings: dict[str, Any],
    routes: list[dict[str, Any]],
    http_filters: list[dict[str, Any]],
) -> dict[str, Any]:
    """The clients' listener (envoy.listen) with one virtual host for every domain."""
    listen = cfg.envoy.listen
    hcm = {
        "stat_prefix": "ingress",
        **hcm_settings,
        "route_config": {
            "name": "ingress",
            "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": routes}],
        },
        "http_filters": http_filters,
    }
    address = {"socket_address": {"address": listen.host, "port_value": listen.port}}
    return {**listener("ingress", address, hcm, cfg), "traffic_direction": "INBOUND"}


def prefill_listener(cfg: Config, listen: str) -> dict[str, Any]:
    """Where the ext_proc sends P legs (loopback or a Unix socket: it has no authentication)."""
    route = {
        "match": {"prefix": "/"},
        "route": {"cluster": "prefill_pool", "timeout": "0s"},  # the ext_proc times P out
        "request_body_buffer_limit": buffer_limit(cfg),
    }
    hcm = {
        "stat_prefix": "prefill",
        "delayed_close_timeout": "0s",
        "local_reply_config": FLAG_LOCAL_REPLIES,
        "route_config": {
            "name": "prefill",
            "virtual_hosts": [{"name": "prefill", "domains": ["*"], "routes": [route]}],
        },
        "http_filters": [router_filter()],
    }
    # OUTBOUND: a graceful drain of the ingress (inboundonly) leaves it serving P legs
    prefill = listener("prefill", socket_address(listen), hcm, cfg)
    return {**prefill, "traffic_direction": "OUTBOUND"}
