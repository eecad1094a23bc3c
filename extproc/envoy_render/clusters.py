"""The three clusters: the ext_proc's gRPC, and the decode and prefill pools.

The pools are real clusters whose override_host policy reads x-gateway-destination-endpoint,
so only pool members can ever be chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from extproc.config import Config
from extproc.eds import eds_path
from extproc.envoy_msgs import DESTINATION_HEADER
from extproc.envoy_render.common import TYPED, UNLIMITED, duration, socket_address
from extproc.envoy_render.ext_proc_filter import EXTPROC_CLUSTER

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # its gRPC health service name
_OVERRIDE_HOST = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
_ROUND_ROBIN = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
_TLS_CONTEXT = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_EXTPROC_MAX_OUTBOUND_FRAMES = 1_000_000


def _endpoints(addresses: list[str]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": socket_address(a)}} for a in addresses]


def _lb_policy(name: str, typed_config: dict[str, Any]) -> dict[str, Any]:
    """Envoy's LoadBalancingPolicy with one typed extension."""
    return {"policies": [{"typed_extension_config": {"name": name, "typed_config": typed_config}}]}


def pool_cluster(
    name: str, addresses: list[str], cfg: Config, eds_dir: Path | None = None
) -> dict[str, Any]:
    """A pool cluster: static members, or (eds_dir) members the ext_proc writes to a file."""
    round_robin = _lb_policy("envoy.load_balancing_policies.round_robin", {TYPED: _ROUND_ROBIN})
    override_host = {
        TYPED: _OVERRIDE_HOST,
        "override_host_sources": [{"header": DESTINATION_HEADER}],
        "fallback_policy": round_robin,  # only for routes without the ext_proc (/v1/models)
    }
    cluster: dict[str, Any] = {
        "name": name,
        "connect_timeout": duration(cfg.timeouts.connect_s),
        "circuit_breakers": {"thresholds": [UNLIMITED]},
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


def extproc_cluster(extproc_address: str, cfg: Config) -> dict[str, Any]:
    """The ext_proc: one address, or several processes (`extproc.workers`) as a comma list."""
    return {
        "name": EXTPROC_CLUSTER,
        # each stream is one request for its whole life: spread by open streams, not by turn
        "lb_policy": "LEAST_REQUEST",
        "type": "STATIC",
        "connect_timeout": duration(cfg.timeouts.connect_s),
        # every in-flight LLM request holds one ext_proc stream: the default 1024 is too low
        "circuit_breakers": {"thresholds": [UNLIMITED]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                TYPED: _HTTP_OPTIONS,
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
    context = {TYPED: _TLS_CONTEXT, "sni": tls.server_name, "common_tls_context": common}
    return {"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": context}}
