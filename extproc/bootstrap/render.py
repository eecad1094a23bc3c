"""Config → the Envoy documents pd-extproc ships: the whole bootstrap (`pd-extproc up`,
`render-envoy`) and the drop-in snippet (`render-envoy --snippet`), as plain dicts rendered as
YAML. Pure: no I/O. The pieces themselves, by name, are in `extproc.bootstrap`.
"""

from __future__ import annotations

from typing import Any

import yaml

from extproc.bootstrap.clusters import EXTPROC_SERVICE
from extproc.bootstrap.common import buffer_limit, router_filter
from extproc.bootstrap.ext_proc_filter import extproc_message_timeout_s
from extproc.bootstrap.listeners import ingress_listener
from extproc.bootstrap.pieces import envoy_pieces
from extproc.config import Config

__all__ = [
    "EXTPROC_SERVICE",
    "NODE",
    "extproc_message_timeout_s",
    "render_bootstrap",
    "render_snippet",
    "render_yaml",
    "snippet_header",
]


# Envoy asks for a node id and cluster before it subscribes to EDS (the pools' members).
NODE = {"id": "pd-extproc", "cluster": "pd-extproc"}


def render_bootstrap(
    cfg: Config, extproc_address: str, prefill_listener: str, eds_access_log: str | None = None
) -> dict[str, Any]:
    """The whole Envoy bootstrap for `cfg`, with the ext_proc at `extproc_address` (which
    also serves the pools' members over EDS and takes the access log, unless `eds_access_log`
    names their own listener)."""
    pieces = envoy_pieces(cfg, extproc_address, prefill_listener, eds_access_log)
    ingress = ingress_listener(
        cfg,
        pieces.ingress_hcm_settings,
        pieces.ingress_routes,
        [pieces.ext_proc_filter, router_filter()],
    )
    admin = cfg.envoy.admin
    return {
        "node": dict(NODE),
        "admin": {"address": {"socket_address": {"address": admin.host, "port_value": admin.port}}},
        "static_resources": {
            "listeners": [ingress, pieces.prefill_listener],
            "clusters": pieces.clusters,
        },
    }


def render_snippet(
    cfg: Config, extproc_address: str, prefill_listener: str, eds_access_log: str | None = None
) -> dict[str, Any]:
    """The pieces to paste into an Envoy that already exists (`render-envoy --snippet`).

    The same objects as in `render_bootstrap`, so a drop-in behaves like `pd-extproc up`;
    the ingress listener and its routes stay the user's own (see `snippet_header`).
    """
    pieces = envoy_pieces(cfg, extproc_address, prefill_listener, eds_access_log)
    return {
        "node": dict(NODE),
        "http_connection_manager": pieces.ingress_hcm_settings,
        "http_filters": [pieces.ext_proc_filter],
        "routes": [*pieces.llm_routes, *pieces.passthrough_routes],
        "every_other_route": pieces.every_other_route,
        "clusters": pieces.clusters,
        "listeners": [pieces.prefill_listener],
    }


def snippet_header(cfg: Config) -> str:
    """YAML comments telling where each piece of `render_snippet` goes."""
    return (
        "# pd-extproc drop-in for an existing Envoy (verified on Envoy 1.40).\n"
        "# node: your bootstrap's node needs an id and a cluster (Envoy asks for both before it\n"
        "#   subscribes to the pools' members); use these if it names none.\n"
        "# http_connection_manager: merge these keys into your ingress http_connection_manager:\n"
        "#   normalised paths (no spelling of a path may dodge the ext_proc's routes) and JSON\n"
        "#   error bodies for Envoy's own replies (a KV-wait timeout, an upstream reset).\n"
        "# http_filters: add to its http_filters, before envoy.filters.http.router (Envoy 1.38\n"
        "#   or later: allow_content_length_header).\n"
        "# routes: put first in the routes of its virtual host: the OpenAI paths through the\n"
        "#   ext_proc with their request body streamed to it (typed_per_filter_config), buffer\n"
        f"#   {buffer_limit(cfg)} bytes, the KV-wait idle_timeout; and the engines' read-only\n"
        "#   endpoints by exact path and method.\n"
        "# every_other_route: merge into each of your other routes: no ext_proc there, and a\n"
        "#   client's copies of the sidecar's headers (x-gateway-destination-endpoint,\n"
        "#   x-data-parallel-rank, ...) removed. A route without the ext_proc that\n"
        "#   reaches the engines must match an exact path and method, never a prefix.\n"
        "# clusters: add to static_resources.clusters (pd_extproc is the ext_proc's gRPC; the\n"
        "#   pools take their members from it over EDS, so they follow its discovery; with\n"
        "#   extproc.eds_access_log, EDS and the access log go to pd_extproc_eds_access_log).\n"
        "# listeners: add to static_resources.listeners; with dispatch.prefill_leg: listener the\n"
        "#   ext_proc sends the prefill leg here (by default it goes straight to the engine). It\n"
        "#   has no authentication: keep it on loopback or a Unix socket.\n"
    )


class _PlainDumper(yaml.SafeDumper):
    """No &anchors/*aliases: a user reads and copies these files piece by piece."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_yaml(bootstrap: dict[str, Any]) -> str:
    return yaml.dump(bootstrap, Dumper=_PlainDumper, sort_keys=False, width=120)


def render_yaml_documents(documents: list[dict[str, Any]], width: int = 100) -> str:
    """Several YAML documents (Kubernetes resources), without anchors either."""
    return yaml.dump_all(documents, Dumper=_PlainDumper, sort_keys=False, width=width)
