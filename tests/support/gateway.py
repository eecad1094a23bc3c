"""An Envoy configured the way a Gateway API Inference Extension gateway wires its endpoint
picker: nothing of it is rendered by pd-extproc.

- ext_proc over TLS that is not verified (the picker's certificate is self-signed), HTTP/2,
  request and response bodies FULL_DUPLEX_STREAMED with the content-length kept, trailers
  SEND, a 5 s message timeout, fail closed;
- the subset hint forwarded from `envoy.lb.subset_hint`, the destination accepted in `envoy.lb`;
  a test sets the hint from the `x-test-subset` header (header_to_metadata, before ext_proc);
- the route's cluster, one of two variants:
    ORIGINAL_DST   connects to whatever address `x-gateway-destination-endpoint` holds
    OVERRIDE_HOST  the pool's endpoints, the picked one read from `envoy.lb` metadata
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from extproc.process.envoy_process import EnvoyProcess

__all__ = ["SUBSET_TEST_HEADER", "Variant", "gateway_bootstrap", "running_gateway"]

SUBSET_TEST_HEADER = "x-test-subset"
_DESTINATION = "x-gateway-destination-endpoint"
_T = "@type"
_API = "type.googleapis.com/envoy"


class Variant(StrEnum):
    ORIGINAL_DST = "original_dst"
    OVERRIDE_HOST = "override_host"


def _socket(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _endpoints(name: str, addresses: Sequence[str]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(a)}} for a in addresses]}],
    }


def _pool_cluster(variant: Variant, members: Sequence[str]) -> dict[str, Any]:
    if variant is Variant.ORIGINAL_DST:
        return {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": _DESTINATION},
        }
    override = {
        _T: f"{_API}.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [
            {"metadata": {"key": "envoy.lb", "path": [{"key": _DESTINATION}]}}
        ],
        "fallback_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.round_robin",
                        "typed_config": {
                            _T: f"{_API}.extensions.load_balancing_policies"
                            ".round_robin.v3.RoundRobin"
                        },
                    }
                }
            ]
        },
    }
    return {
        "name": "pool",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": _endpoints("pool", members),
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": override,
                    }
                }
            ]
        },
    }


def _epp_cluster(epp: str) -> dict[str, Any]:
    return {
        "name": "epp",
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": _endpoints("epp", [epp]),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                _T: f"{_API}.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "transport_socket": {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                _T: f"{_API}.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"validation_context": {}},  # no verification
            },
        },
    }


def _filters() -> list[dict[str, Any]]:
    subset_rule = {
        "header": SUBSET_TEST_HEADER,
        "remove": True,
        "on_header_present": {
            "metadata_namespace": "envoy.lb.subset_hint",
            "key": "x-gateway-destination-endpoint-subset",
            "type": "STRING",
        },
    }
    ext_proc = {
        _T: f"{_API}.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp", "authority": "epp.test.svc"}},
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND",
            "response_header_mode": "SEND",
            "response_body_mode": "FULL_DUPLEX_STREAMED",
            "response_trailer_mode": "SEND",
        },
        "allow_content_length_header": True,
        "message_timeout": "5s",
        "failure_mode_allow": False,
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
        },
    }
    return [
        {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                _T: f"{_API}.extensions.filters.http.header_to_metadata.v3.Config",
                "request_rules": [subset_rule],
            },
        },
        {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
        {
            "name": "envoy.filters.http.router",
            "typed_config": {_T: f"{_API}.extensions.filters.http.router.v3.Router"},
        },
    ]


def gateway_bootstrap(variant: Variant, epp: str, members: Sequence[str]) -> dict[str, Any]:
    manager = {
        _T: f"{_API}.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "60s"}},
                    ],
                }
            ]
        },
        "http_filters": _filters(),
    }
    listener = {
        "name": "gateway",
        "address": _socket("127.0.0.1:0"),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    return {
        "admin": {"address": _socket("127.0.0.1:0")},
        "static_resources": {
            "listeners": [listener],
            "clusters": [_pool_cluster(variant, members), _epp_cluster(epp)],
        },
    }


@contextlib.asynccontextmanager
async def running_gateway(variant: Variant, epp: str, members: Sequence[str]) -> AsyncIterator[str]:
    """The gateway's URL while its Envoy runs."""
    with tempfile.TemporaryDirectory(prefix="pd-extproc-gateway-") as tmp:
        run_dir = Path(tmp)
        config = run_dir / "envoy.yaml"
        config.write_text(yaml.safe_dump(gateway_bootstrap(variant, epp, members)))
        envoy = EnvoyProcess(config, run_dir, "warning", 1)
        await envoy.start()
        try:
            yield f"http://{await envoy.listener_address('gateway')}"
        finally:
            await envoy.stop()
