"""Config → Envoy bootstrap (a plain dict, rendered as YAML). Pure: no I/O.

The settings follow the measurements in DESIGN.md / envoy-extproc.md:
- ext_proc: request headers SEND + body BUFFERED (routing can depend on the body and
  content-length is kept), response headers SEND (the sidecar sees D's status; one cheap
  round trip that overlaps decoding), response body NONE (SSE streams through untouched),
  fail closed with 503, a message timeout sized for a burst of large bodies, extendable to the
  prefill timeout.
- decode_pool / prefill_pool: real clusters with the override_host LB policy reading
  x-gateway-destination-endpoint, so only pool members can ever be chosen.
- the prefill leg enters through a listener bound to loopback or a Unix socket.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from extproc.bodies import buffer_bytes
from extproc.config import Config, parse_host_port
from extproc.eds import eds_path
from extproc.envoy_msgs import DESTINATION_HEADER
from extproc.errors import error_body
from extproc.prefill_leg import LOCAL_REPLY_HEADER
from extproc.request import PATHS

__all__ = [
    "EXTPROC_CLUSTER",
    "PASSTHROUGH",
    "PATH_HANDLING",
    "extproc_message_timeout_s",
    "render_bootstrap",
    "render_snippet",
    "render_yaml",
    "snippet_header",
]

EXTPROC_CLUSTER = "pd_extproc"
_TYPED = "@type"
_HCM = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
    ".HttpConnectionManager"
)
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_EXT_PROC_PER_ROUTE = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_OVERRIDE_HOST = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
_ROUND_ROBIN = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
_CEL_FILTER = "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter"
_TLS_CONTEXT = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # its gRPC health service name
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# Engine endpoints that need no P/D routing (any decode engine answers them), each with the one
# method it serves. Matched exactly, on the normalised path and that method, so that no other
# target and no client body meant for a completion reaches an engine past the ext_proc.
PASSTHROUGH = {
    "/v1/models": "GET", "/health": "GET", "/metrics": "GET", "/version": "GET",
    "/tokenize": "POST", "/detokenize": "POST",
}  # fmt: skip
_EXTPROC_MAX_OUTBOUND_FRAMES = 1_000_000
_UNLIMITED = {
    "max_connections": 100000,
    "max_pending_requests": 100000,
    "max_requests": 100000,
    "max_retries": 1000,
}


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def socket_address(listen: str) -> dict[str, Any]:
    """'unix:/path' → a pipe address; 'host:port' → a socket address."""
    if listen.startswith("unix:"):
        return {"pipe": {"path": listen.removeprefix("unix:"), "mode": 0o600}}
    host, port = parse_host_port(listen)
    return {"socket_address": {"address": host, "port_value": port}}


def _router() -> dict[str, Any]:
    return {"name": "envoy.filters.http.router", "typed_config": {_TYPED: _ROUTER}}


# Sizing of Envoy's ext_proc message timer. It runs from sending a message to its answer, and
# Envoy sends the bodies of concurrent requests interleaved on one HTTP/2 connection: a body
# in a burst is complete at the ext_proc only when about the whole burst is, so its timer
# covers every byte in flight, not just its own (with 1 s, 11 of 12 concurrent 10 MB bodies
# failed). On a busy 2-vCPU machine Envoy, the ext_proc and the engines together took in
# bursts at 20-30 MB/s (12 x 10 MB in 4-6.5 s, 200 x 0.5 MB in 2-3.5 s). The default leaves
# 1 s for a stalled Python process plus room for 16 bodies of the maximum size in flight at
# 30 MB/s: 9.9 s for 16 MiB. A longer timer costs little: an ext_proc that is down fails at
# once (503), and one that is merely slow has done the work a 504 would throw away.
_STALL_S = 1.0
_BURST_BODIES = 16
_BURST_BYTES_PER_S = 30e6


def extproc_message_timeout_s(cfg: Config) -> float:
    """timeouts.extproc_message_s, or by default sized from limits.max_body_bytes."""
    if cfg.timeouts.extproc_message_s is not None:
        return cfg.timeouts.extproc_message_s
    burst = _BURST_BODIES * cfg.limits.max_body_bytes / _BURST_BYTES_PER_S
    return round(_STALL_S + burst, 1)


def _ext_proc_filter(cfg: Config) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            _TYPED: _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
            "failure_mode_allow": False,  # without the ext_proc there is no decode target
            "status_on_error": {"code": 503},
            "message_timeout": _duration(extproc_message_timeout_s(cfg)),
            # serial dispatch extends the timer while P computes (override_message_timeout)
            "max_message_timeout": _duration(cfg.timeouts.prefill_s + 5),
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
        },
    }


# Envoy refuses a path it cannot normalise (normalize_path) or one with an escaped slash
# (path_with_escaped_slashes_action) with this single detail.
_BAD_PATH = (
    "the request target is not a plain path: it has an encoded slash or backslash (%2F, %5C), "
    "a '#fragment' (which HTTP clients must not send) or an escape that does not resolve; "
    "send e.g. POST /v1/completions"
)


def _cel(expression: str) -> dict[str, Any]:
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {_TYPED: _CEL_FILTER, "expression": expression},
        }
    }


def _json_reply(status: int, message: str, when: str | None = None) -> dict[str, Any]:
    """A local-reply mapper that gives Envoy's own `status` replies (those for which the CEL
    `when` holds) an OpenAI-style JSON body. It matches that one status, so the HTTP status and
    the body's `code` always agree."""
    expression = f"response.code == {status}" + (f" && ({when})" if when else "")
    return {
        "filter": _cel(expression),
        "body": {"inline_string": error_body(status, message).decode()},
        "headers_to_add": [
            {
                "header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
    }


def _ingress_local_replies(cfg: Config) -> dict[str, Any]:
    limit = cfg.limits.max_body_bytes
    # The ext_proc's own ImmediateResponses (its 413 too) carry their JSON already (details
    # pd_extproc_*).
    envoys_own = "!response.code_details.startsWith('pd_extproc')"
    # No answer from the ext_proc (details ext_proc_error_*): a stream that cannot open or
    # breaks gets `status_on_error` (503); a message left unanswered for the message timeout
    # gets 504 (status_on_error does not apply to it).
    extproc_failed = "response.code_details.startsWith('ext_proc_error')"
    # Every other error Envoy makes itself (upstream connect failure or reset, the KV-wait
    # idle timeout): its own text, wrapped in the OpenAI error shape; the code is the status.
    # A route's own direct_response (a user's Envoy, with the snippet) is left as it is.
    not_a_route_reply = "response.code_details != 'direct_response'"
    wrapped = {
        "json_format": {
            "error": {
                "message": "%LOCAL_REPLY_BODY%",
                "type": "UpstreamError",
                "param": None,
                "code": "%RESPONSE_CODE%",
            }
        },
        "content_type": "application/json",
    }
    return {"mappers": [
        _json_reply(413, f"request body exceeds the limit of {limit} bytes", envoys_own),
        _json_reply(400, _BAD_PATH, "response.code_details == 'path_normalization_failed'"),
        _json_reply(504, "the pd-extproc ext_proc did not answer within its message timeout "
                    "(timeouts.extproc_message_s); retry", extproc_failed),
        _json_reply(503, "the pd-extproc ext_proc is unavailable; retry", extproc_failed),
        {"filter": _cel(f"response.code >= 400 && {envoys_own} && {not_a_route_reply}"),
         "body_format_override": wrapped},
    ]}  # fmt: skip


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


def _method(method: str) -> dict[str, Any]:
    return {"name": ":method", "string_match": {"exact": method}}


def _llm_routes(cfg: Config) -> list[dict[str, Any]]:
    """The OpenAI paths: through the ext_proc to decode_pool."""
    return [
        {"match": {"path": path}, "route": _decode_route(cfg),
         "request_body_buffer_limit": _buffer_limit(cfg)}
        for path in sorted(PATHS)
    ]  # fmt: skip


def _decode_route(cfg: Config) -> dict[str, Any]:
    return {
        "cluster": "decode_pool",
        "timeout": "0s",  # generations stream for minutes; the ext_proc bounds the P leg
        "idle_timeout": _duration(cfg.timeouts.kv_wait_s),  # a D waiting for KV forever
        # a refused connection is retried on the next host of the ext_proc's list
        "retry_policy": {"retry_on": "connect-failure", "num_retries": 1},
    }


# Every route that skips the ext_proc: a client's destination header must not steer it.
WITHOUT_EXTPROC = {
    "request_headers_to_remove": [DESTINATION_HEADER],
    "typed_per_filter_config": {
        "envoy.filters.http.ext_proc": {_TYPED: _EXT_PROC_PER_ROUTE, "disabled": True}
    },
}


def _passthrough_routes() -> list[dict[str, Any]]:
    """The engines' read-only endpoints, by exact path and method, without the ext_proc."""
    return [
        {"match": {"path": path, "headers": [_method(method)]},
         "route": {"cluster": "decode_pool", "timeout": "60s"}, **WITHOUT_EXTPROC}
        for path, method in PASSTHROUGH.items()
    ]  # fmt: skip


def _ingress_routes(cfg: Config) -> list[dict[str, Any]]:
    # Everything else goes through the ext_proc too, which answers 404/405 in JSON.
    catch_all = {"match": {"prefix": "/"}, "route": _decode_route(cfg)}
    return [*_llm_routes(cfg), *_passthrough_routes(), catch_all]


def _ingress_hcm_settings(cfg: Config) -> dict[str, Any]:
    """What the ingress connection manager needs besides its routes and filters."""
    return {
        "delayed_close_timeout": "0s",  # resets reach HTTP/1.1 clients at once
        **PATH_HANDLING,
        "local_reply_config": _ingress_local_replies(cfg),
    }


def _buffer_limit(cfg: Config) -> int:
    """Envoy's buffers hold the bodies the ext_proc builds, which are longer than the client's.

    The client's limit stays exactly limits.max_body_bytes: the ext_proc checks it on the
    client's body (413) before any leg leaves. Sizing Envoy's buffers to that limit instead
    would refuse a spliced body after P had already run.
    """
    return buffer_bytes(cfg.limits.max_body_bytes)


def _listener(name: str, address: dict[str, Any], hcm: dict[str, Any], cfg: Config) -> dict:
    return {
        "name": name,
        "address": address,
        "per_connection_buffer_limit_bytes": _buffer_limit(cfg),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager",
                          "typed_config": {_TYPED: _HCM, **hcm}}]}
        ],
    }  # fmt: skip


def _ingress_listener(cfg: Config) -> dict[str, Any]:
    listen = cfg.envoy.listen
    hcm = {
        "stat_prefix": "ingress",
        **_ingress_hcm_settings(cfg),
        "route_config": {
            "name": "ingress",
            "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": _ingress_routes(cfg)}],
        },
        "http_filters": [_ext_proc_filter(cfg), _router()],
    }
    address = {"socket_address": {"address": listen.host, "port_value": listen.port}}
    return {**_listener("ingress", address, hcm, cfg), "traffic_direction": "INBOUND"}


# Envoy's own replies (connect failure, reset) carry their response flags, so the ext_proc
# can tell "P unreachable" from "P answered 503".
_FLAG_LOCAL_REPLIES = {
    "mappers": [
        {
            "filter": {"not_health_check_filter": {}},
            "headers_to_add": [
                {"header": {"key": LOCAL_REPLY_HEADER, "value": "%RESPONSE_FLAGS%"}}
            ],
        }
    ]
}


def _prefill_listener(cfg: Config, prefill_listener: str) -> dict[str, Any]:
    route = {
        "match": {"prefix": "/"},
        "route": {"cluster": "prefill_pool", "timeout": "0s"},  # the ext_proc times P out
        "request_body_buffer_limit": _buffer_limit(cfg),
    }
    hcm = {
        "stat_prefix": "prefill",
        "delayed_close_timeout": "0s",
        "local_reply_config": _FLAG_LOCAL_REPLIES,
        "route_config": {
            "name": "prefill",
            "virtual_hosts": [{"name": "prefill", "domains": ["*"], "routes": [route]}],
        },
        "http_filters": [_router()],
    }
    # OUTBOUND: a graceful drain of the ingress (inboundonly) leaves it serving P legs
    prefill = _listener("prefill", socket_address(prefill_listener), hcm, cfg)
    return {**prefill, "traffic_direction": "OUTBOUND"}


def _endpoints(addresses: list[str]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": socket_address(a)}} for a in addresses]


def _lb_policy(name: str, typed_config: dict[str, Any]) -> dict[str, Any]:
    """Envoy's LoadBalancingPolicy with one typed extension."""
    return {"policies": [{"typed_extension_config": {"name": name, "typed_config": typed_config}}]}


def _pool_cluster(
    name: str, addresses: list[str], cfg: Config, eds_dir: Path | None = None
) -> dict[str, Any]:
    """A pool cluster: static members, or (eds_dir) members the ext_proc writes to a file."""
    round_robin = _lb_policy("envoy.load_balancing_policies.round_robin", {_TYPED: _ROUND_ROBIN})
    override_host = {
        _TYPED: _OVERRIDE_HOST,
        "override_host_sources": [{"header": DESTINATION_HEADER}],
        "fallback_policy": round_robin,  # only for routes without the ext_proc (/v1/models)
    }
    cluster: dict[str, Any] = {
        "name": name,
        "connect_timeout": _duration(cfg.timeouts.connect_s),
        "circuit_breakers": {"thresholds": [_UNLIMITED]},
        "load_balancing_policy": _lb_policy(
            "envoy.load_balancing_policies.override_host", override_host
        ),
    }
    if eds_dir is None:
        endpoints = [{"lb_endpoints": _endpoints(addresses)}]
        return {**cluster, "type": "STATIC",
                "load_assignment": {"cluster_name": name, "endpoints": endpoints}}  # fmt: skip
    source = {
        "path_config_source": {
            "path": str(eds_path(eds_dir, name)),
            "watched_directory": {"path": str(eds_dir)},
        },
        "resource_api_version": "V3",
    }
    return {**cluster, "type": "EDS",
            "eds_cluster_config": {"service_name": name, "eds_config": source}}  # fmt: skip


def _extproc_cluster(extproc_address: str, cfg: Config) -> dict[str, Any]:
    """The ext_proc: one address, or several processes (`extproc.workers`) as a comma list."""
    return {
        "name": EXTPROC_CLUSTER,
        # each stream is one request for its whole life: spread by open streams, not by turn
        "lb_policy": "LEAST_REQUEST",
        "type": "STATIC",
        "connect_timeout": _duration(cfg.timeouts.connect_s),
        # every in-flight LLM request holds one ext_proc stream: the default 1024 is too low
        "circuit_breakers": {"thresholds": [_UNLIMITED]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                _TYPED: _HTTP_OPTIONS,
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "connection_keepalive": {"interval": "30s", "timeout": "5s"},
                        # Envoy's flood guard (10000 queued frames by default) is for untrusted
                        # peers. A burst of 600 x 0.5 MB bodies queues ~20000 DATA frames while
                        # the ext_proc reads slower than Envoy writes, and tripping it closes the
                        # connection: every in-flight request fails at once. The bodies queued
                        # are bounded by the requests' own buffer limits anyway.
                        "max_outbound_frames": _EXTPROC_MAX_OUTBOUND_FRAMES,
                    }
                },
            }
        },
        "load_assignment": {
            "cluster_name": EXTPROC_CLUSTER,
            "endpoints": [{"lb_endpoints": _endpoints(extproc_address.split(","))}],
        },
        # the gRPC health service of the ext_proc (NOT_SERVING while it drains)
        "health_checks": [{
            "timeout": "1s", "interval": "5s", "unhealthy_threshold": 2, "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EXTPROC_SERVICE},
        }],
        **_extproc_tls(cfg),
    }  # fmt: skip


def _extproc_tls(cfg: Config) -> dict[str, Any]:
    """Envoy's side of TLS to the ext_proc: trust its CA, check its name, maybe mTLS."""
    tls = cfg.extproc.tls
    if tls is None:
        return {}
    name = {"san_type": "DNS", "matcher": {"exact": tls.server_name}}
    common: dict[str, Any] = {"validation_context": {
        "trusted_ca": {"filename": tls.ca_file}, "match_typed_subject_alt_names": [name],
    }}  # fmt: skip
    if tls.client_cert_file and tls.client_key_file:
        common["tls_certificates"] = [{
            "certificate_chain": {"filename": tls.client_cert_file},
            "private_key": {"filename": tls.client_key_file},
        }]  # fmt: skip
    context = {_TYPED: _TLS_CONTEXT, "sni": tls.server_name, "common_tls_context": common}
    return {"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": context}}


def render_bootstrap(
    cfg: Config, extproc_address: str, prefill_listener: str, eds_dir: Path | None = None
) -> dict[str, Any]:
    """The whole Envoy bootstrap for `cfg`, with the ext_proc at `extproc_address`.

    With `eds_dir`, pool membership comes from the EDS files the ext_proc keeps there
    (`extproc.eds`); without it, from the static endpoint lists of the config.
    """
    admin = cfg.envoy.admin
    return {
        "node": {"id": "pd-extproc", "cluster": "pd-extproc"},  # file-based EDS needs both
        "admin": {"address": {"socket_address": {"address": admin.host, "port_value": admin.port}}},
        "static_resources": {
            "listeners": [_ingress_listener(cfg), _prefill_listener(cfg, prefill_listener)],
            "clusters": [
                _extproc_cluster(extproc_address, cfg),
                _pool_cluster("decode_pool", cfg.static_addresses("decode"), cfg, eds_dir),
                _pool_cluster("prefill_pool", cfg.static_addresses("prefill"), cfg, eds_dir),
            ],
        },
    }


def render_snippet(cfg: Config, extproc_address: str, prefill_listener: str) -> dict[str, Any]:
    """The pieces to paste into an Envoy that already exists (`render-envoy --snippet`).

    The same objects as in `render_bootstrap`, so a drop-in behaves like `pd-extproc up`;
    the ingress listener and its routes stay the user's own (see `snippet_header`).
    """
    return {
        "http_connection_manager": _ingress_hcm_settings(cfg),
        "http_filters": [_ext_proc_filter(cfg)],
        "routes": [*_llm_routes(cfg), *_passthrough_routes()],
        "every_other_route": WITHOUT_EXTPROC,
        "clusters": [
            _extproc_cluster(extproc_address, cfg),
            _pool_cluster("decode_pool", cfg.static_addresses("decode"), cfg),
            _pool_cluster("prefill_pool", cfg.static_addresses("prefill"), cfg),
        ],
        "listeners": [_prefill_listener(cfg, prefill_listener)],
    }


def snippet_header(cfg: Config) -> str:
    """YAML comments telling where each piece of `render_snippet` goes."""
    return (
        "# pd-extproc drop-in for an existing Envoy (verified on Envoy 1.40).\n"
        "# http_connection_manager: merge these keys into your ingress http_connection_manager:\n"
        "#   normalised paths (no spelling of a path may dodge the ext_proc's routes) and JSON\n"
        "#   error bodies for Envoy's own replies (a KV-wait timeout, an upstream reset).\n"
        "# http_filters: add to its http_filters, before envoy.filters.http.router.\n"
        "# routes: put first in the routes of its virtual host: the OpenAI paths through the\n"
        f"#   ext_proc (buffer {_buffer_limit(cfg)} bytes, the KV-wait idle_timeout), and the\n"
        "#   engines' read-only endpoints by exact path and method.\n"
        "# every_other_route: merge into each of your other routes: no ext_proc there, and a\n"
        "#   client's x-gateway-destination-endpoint removed. A route without the ext_proc that\n"
        "#   reaches the engines must match an exact path and method, never a prefix.\n"
        "# clusters: add to static_resources.clusters (pd_extproc is the ext_proc's gRPC).\n"
        "# listeners: add to static_resources.listeners; the ext_proc sends the prefill leg\n"
        "#   here. It has no authentication: keep it on loopback or a Unix socket.\n"
    )


class _PlainDumper(yaml.SafeDumper):
    """No &anchors/*aliases: a user reads and copies these files piece by piece."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_yaml(bootstrap: dict[str, Any]) -> str:
    return yaml.dump(bootstrap, Dumper=_PlainDumper, sort_keys=False, width=120)
