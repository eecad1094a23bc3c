"""The clusters: the ext_proc's gRPC, and the decode and prefill pools (and, with
extproc.eds_access_log, the listener of the ext_proc's EDS and access log).

The pools are real clusters whose override_host policy reads x-gateway-destination-endpoint,
so only pool members can ever be chosen. Their members come over gRPC EDS from the ext_proc
itself (through its cluster, or the EDS and access-log one), so Envoy follows every discovery
source and reload.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from extproc.bootstrap.common import TYPED, UNLIMITED, duration, socket_address
from extproc.bootstrap.ext_proc_filter import EXTPROC_CLUSTER
from extproc.config import Config, ConfigError, parse_host_port
from extproc.headers import DESTINATION_HEADER

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # its gRPC health service name
EDS_ACCESS_LOG_CLUSTER = "pd_extproc_eds_access_log"  # extproc.eds_access_log's listener
_OVERRIDE_HOST = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
_ROUND_ROBIN = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
_TLS_CONTEXT = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_EXTPROC_MAX_OUTBOUND_FRAMES = 1_000_000
# How long Envoy's start waits for the pools' first EDS answer. An ext_proc that is up answers
# in milliseconds; one that is down must not hold a user's whole Envoy (its other routes too)
# for Envoy's default 15 s. The pools are empty until it answers: LLM requests fail anyway then.
_EDS_INITIAL_FETCH_S = 5
# Envoy re-opens a broken EDS stream with backoff (by default up to 30 s apart): cap it, so a
# restarted ext_proc is reached within seconds. Meanwhile Envoy keeps the endpoints it has.
_EDS_RETRY_BACKOFF = {"base_interval": "0.5s", "max_interval": "5s"}


def _endpoints(addresses: list[str]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": socket_address(a)}} for a in addresses]


def _lb_policy(name: str, typed_config: dict[str, Any]) -> dict[str, Any]:
    """Envoy's LoadBalancingPolicy with one typed extension."""
    return {"policies": [{"typed_extension_config": {"name": name, "typed_config": typed_config}}]}


def _pool_base(name: str, cfg: Config) -> dict[str, Any]:
    round_robin = _lb_policy("envoy.load_balancing_policies.round_robin", {TYPED: _ROUND_ROBIN})
    override_host = {
        TYPED: _OVERRIDE_HOST,
        "override_host_sources": [{"header": DESTINATION_HEADER}],
        "fallback_policy": round_robin,  # only for routes without the ext_proc (/v1/models)
    }
    return {
        "name": name,
        "connect_timeout": duration(cfg.timeouts.connect_s),
        "circuit_breakers": {"thresholds": [UNLIMITED]},
        "load_balancing_policy": _lb_policy(
            "envoy.load_balancing_policies.override_host", override_host
        ),
    }


def pool_cluster(name: str, cfg: Config, eds_cluster: str = EXTPROC_CLUSTER) -> dict[str, Any]:
    """A pool cluster whose members the ext_proc serves over EDS (resource name = `name`),
    through `eds_cluster`."""
    grpc = {
        "envoy_grpc": {
            "cluster_name": eds_cluster,
            "retry_policy": {"retry_back_off": _EDS_RETRY_BACKOFF},
        }
    }
    source = {
        "api_config_source": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "grpc_services": [grpc],
            "set_node_on_first_message_only": True,
        },
        "initial_fetch_timeout": duration(_EDS_INITIAL_FETCH_S),
        "resource_api_version": "V3",
    }
    return {
        **_pool_base(name, cfg),
        "type": "EDS",
        "eds_cluster_config": {"service_name": name, "eds_config": source},
    }


def static_pool_cluster(name: str, addresses: list[str], cfg: Config) -> dict[str, Any]:
    """A pool cluster with the config's static members, for an Envoy that takes its clusters
    over CDS (an Istio EnvoyFilter): Envoy refuses an EDS source through a cluster that did
    not come from its bootstrap, and the ext_proc's cluster would be one."""
    endpoints = [{"lb_endpoints": _endpoints(addresses)}]
    return {
        **_pool_base(name, cfg),
        "type": "STATIC",
        "load_assignment": {"cluster_name": name, "endpoints": endpoints},
    }


def _named_host(address: str) -> bool:
    """Whether the ext_proc's address names a host (a Service) rather than an IP or a socket."""
    if address.startswith("unix:"):
        return False
    try:
        host, _ = parse_host_port(address)
    except ValueError as error:
        raise ConfigError(f"ext_proc address {address!r}: {error}") from None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def _http2_options() -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            TYPED: _HTTP_OPTIONS,
            "explicit_http_config": {
                "http2_protocol_options": {
                    "connection_keepalive": {"interval": "30s", "timeout": "5s"}
                }
            },
        }
    }


def eds_access_log_cluster(address: str, cfg: Config) -> dict[str, Any]:
    """The ext_proc's EDS and access-log listener (extproc.eds_access_log): loopback or a Unix
    socket, plaintext; a few long-lived streams."""
    return {
        "name": EDS_ACCESS_LOG_CLUSTER,
        "type": "STATIC",
        "connect_timeout": duration(cfg.timeouts.connect_s),
        "typed_extension_protocol_options": _http2_options(),
        "load_assignment": {
            "cluster_name": EDS_ACCESS_LOG_CLUSTER,
            "endpoints": [{"lb_endpoints": _endpoints([address])}],
        },
    }


def extproc_cluster(extproc_address: str, cfg: Config) -> dict[str, Any]:
    """The ext_proc: one address, or several processes (`extproc.workers`) as a comma list."""
    addresses = extproc_address.split(",")
    named = any([_named_host(a) for a in addresses])
    return {
        "name": EXTPROC_CLUSTER,
        # each stream is one request for its whole life: spread by open streams, not by turn
        "lb_policy": "LEAST_REQUEST",
        # a STATIC cluster takes IP addresses only: a name (the ext_proc's Service) is resolved
        "type": "STRICT_DNS" if named else "STATIC",
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
            "endpoints": [{"lb_endpoints": _endpoints(addresses)}],
        },
        # the gRPC health service of the ext_proc (NOT_SERVING while it drains)
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "5s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXTPROC_SERVICE},
            }
        ],
        **_extproc_tls(cfg),
    }


def _extproc_tls(cfg: Config) -> dict[str, Any]:
    """Envoy's side of TLS to the ext_proc: trust its CA, check its name, maybe mTLS."""
    tls = cfg.extproc.tls
    if tls is None:
        return {}
    name = {"san_type": "DNS", "matcher": {"exact": tls.server_name}}
    common: dict[str, Any] = {
        "validation_context": {
            "trusted_ca": {"filename": tls.ca_file},
            "match_typed_subject_alt_names": [name],
        }
    }
    if tls.client_cert_file and tls.client_key_file:
        common["tls_certificates"] = [
            {
                "certificate_chain": {"filename": tls.client_cert_file},
                "private_key": {"filename": tls.client_key_file},
            }
        ]
    context = {TYPED: _TLS_CONTEXT, "sni": tls.server_name, "common_tls_context": common}
    return {"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": context}}
