"""The two listeners: the ingress (clients) and the prefill listener (the ext_proc's P legs)."""

from __future__ import annotations

from typing import Any

from extproc.bootstrap.common import (
    TYPED,
    buffer_limit,
    duration,
    listener,
    router_filter,
    socket_address,
)
from extproc.bootstrap.ext_proc_filter import EXTPROC_CLUSTER
from extproc.bootstrap.local_replies import FLAG_LOCAL_REPLIES, ingress_local_replies
from extproc.config import Config
from extproc.request.envoy_msgs import LABELS_NAMESPACE

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


_HTTP_GRPC_LOG = (
    "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
)


def client_latency_log(cfg: Config, cluster: str = EXTPROC_CLUSTER) -> dict[str, Any]:
    """Envoy's access log streamed to the ext_proc (`extproc.request.access_log`) through
    `cluster`: the client's own time to first byte and duration. Only requests the ext_proc
    labelled are sent."""
    labelled = {
        "matcher": {
            "filter": LABELS_NAMESPACE,
            "path": [{"key": "strategy"}],
            "value": {"present_match": True},
        },
        "match_if_key_not_found": False,
    }
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"metadata_filter": labelled},
        "typed_config": {
            TYPED: _HTTP_GRPC_LOG,
            "common_config": {
                "log_name": "pd_extproc_client_latency",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                "buffer_flush_interval": duration(cfg.access_log.flush_interval_s),
            },
        },
    }


def ingress_hcm_settings(cfg: Config, access_log_cluster: str = EXTPROC_CLUSTER) -> dict[str, Any]:
    """What the ingress connection manager needs besides its routes and filters."""
    enabled = cfg.access_log.enabled
    access_log = [client_latency_log(cfg, access_log_cluster)] if enabled else []
    return {
        "delayed_close_timeout": "0s",  # resets reach HTTP/1.1 clients at once
        **PATH_HANDLING,
        "local_reply_config": ingress_local_replies(cfg),
        **({"access_log": access_log} if access_log else {}),
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
