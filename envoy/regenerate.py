"""Write every Envoy configuration rendered from a pd-extproc config: the golden files in
envoy/, and the copies the Kubernetes examples need beside their kustomization.yaml (kustomize
reads files from its own folder only). They never drift from what `pd-extproc render-envoy`
produces: tests/deploy runs the check.

    python envoy/regenerate.py          # rewrite the files
    python envoy/regenerate.py --check  # exit 1 and name the stale files (tests do this)
"""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from extproc.bootstrap.clusters import static_pool_cluster
from extproc.bootstrap.common import HCM_FILTER, HCM_TYPE
from extproc.bootstrap.pieces import EnvoyPieces, envoy_pieces
from extproc.bootstrap.render import render_yaml, render_yaml_documents
from extproc.cli import main as cli_main
from extproc.config import Config, load_config
from extproc.membership.eds import pool_cluster_name
from extproc.roles import Role

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "envoy"
PREFILL_LISTENER = "127.0.0.1:10001"
# The Istio gateway serves the LLM API on this host (Gateway server port 80 → pod port 8080).
ISTIO_HOSTS = ["llm.example.com", "llm.example.com:*"]
ISTIO_GATEWAY_POD_PORT = 8080
ISTIO_GATEWAY_SERVER_PORT = 80


def _cli(*argv: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        if cli_main(list(argv)) != 0:
            raise SystemExit(f"pd-extproc {' '.join(argv)} failed")
    return out.getvalue()


def _bootstrap(config: Path) -> str:
    return _cli("render-envoy", "--config", str(config), "--prefill-listener", PREFILL_LISTENER)


def _snippet(config: Path) -> str:
    return _cli(
        "render-envoy", "--config", str(config), "--snippet", "--prefill-listener", PREFILL_LISTENER
    )


def _dump(header: str, documents: list[dict[str, Any]]) -> str:
    return header + render_yaml_documents(documents)


def prefill_only_envoy(config: Path) -> dict[str, Any]:
    """Envoy Gateway runs the ext_proc in its own pod: a small Envoy there keeps the prefill
    listener on loopback, with only the prefill listener and prefill_pool."""
    cfg = load_config(config)
    pieces = _pieces(cfg)
    admin = cfg.envoy.admin
    return {
        "admin": {"address": {"socket_address": {"address": admin.host, "port_value": admin.port}}},
        "static_resources": {
            "listeners": [pieces.prefill_listener],
            # static like the gateway's decode Backend (pools over EDS would take the ext_proc's
            # TLS client settings in this Envoy too)
            "clusters": [_static_pool(cfg, Role.PREFILL)],
        },
    }


def _static_pool(cfg: Config, role: Role) -> dict[str, Any]:
    return static_pool_cluster(pool_cluster_name(role), cfg.static_addresses(role), cfg)


def _pieces(cfg: Config) -> EnvoyPieces:
    """The pieces for an ext_proc beside Envoy in one pod (loopback gRPC)."""
    return envoy_pieces(cfg, f"127.0.0.1:{cfg.extproc.port}", PREFILL_LISTENER)


def _istio_patch(apply_to: str, match: dict[str, Any], operation: str, value: Any) -> dict:
    return {
        "applyTo": apply_to,
        "match": {"context": "GATEWAY", **match},
        "patch": {"operation": operation, "value": value},
    }


_GATEWAY_HCM = {"filter": {"name": HCM_FILTER, "subFilter": {"name": "envoy.filters.http.router"}}}


def istio_envoyfilter(config: Path) -> dict[str, Any]:
    cfg = load_config(config)
    pieces = _pieces(cfg)  # the pd-extproc container is in the gateway pod
    on_gateway_http = {
        "listener": {"portNumber": ISTIO_GATEWAY_POD_PORT, "filterChain": _GATEWAY_HCM}
    }
    vhost = {"name": "pd-extproc-llm", "domains": ISTIO_HOSTS, "routes": pieces.ingress_routes}
    on_gateway_routes = {"routeConfiguration": {"portNumber": ISTIO_GATEWAY_SERVER_PORT}}
    on_gateway_hcm = {
        "listener": {
            "portNumber": ISTIO_GATEWAY_POD_PORT,
            "filterChain": {"filter": {"name": HCM_FILTER}},
        }
    }
    path_handling = {"typed_config": {"@type": HCM_TYPE, **pieces.ingress_hcm_settings}}
    # An EnvoyFilter's clusters arrive over CDS, and Envoy takes EDS only through a bootstrap
    # cluster: the pools here are the config's static lists.
    pools = [_static_pool(cfg, Role.DECODE), _static_pool(cfg, Role.PREFILL)]
    patches = [
        _istio_patch("NETWORK_FILTER", on_gateway_hcm, "MERGE", path_handling),
        _istio_patch("HTTP_FILTER", on_gateway_http, "INSERT_BEFORE", pieces.ext_proc_filter),
        *(_istio_patch("CLUSTER", {}, "ADD", c) for c in [pieces.extproc_cluster, *pools]),
        _istio_patch("LISTENER", {}, "ADD", pieces.prefill_listener),
        _istio_patch("VIRTUAL_HOST", on_gateway_routes, "ADD", vhost),
    ]
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "pd-extproc", "namespace": "llm"},
        "spec": {"workloadSelector": {"labels": {"app": "llm-gateway"}}, "configPatches": patches},
    }


_ISTIO_HEADER = """\
# Generated by envoy/regenerate.py from examples/istio/pd-extproc.yaml: do not edit by hand.
# Inserts pd-extproc into the Istio ingress gateway labelled app=llm-gateway (examples/istio/
# gateway.yaml): path normalisation on its HTTP connection manager, the ext_proc filter before
# the router, the pd_extproc / decode_pool / prefill_pool clusters, the loopback prefill listener
# and a virtual host for the LLM API. The pools are the config's static lists here, not EDS:
# Envoy takes EDS only through a cluster of its bootstrap, and an EnvoyFilter's come over CDS.
"""


def expected() -> dict[Path, str]:
    """Every generated file → its content."""
    return {
        GOLDEN / "compose-bootstrap.yaml": _bootstrap(ROOT / "deploy" / "pd-extproc.yaml"),
        GOLDEN / "bootstrap.yaml": _bootstrap(EXAMPLES / "plain-envoy" / "pd-extproc.yaml"),
        GOLDEN / "snippet.yaml": _snippet(EXAMPLES / "plain-envoy" / "pd-extproc.yaml"),
        EXAMPLES / "kubernetes" / "envoy.yaml": _bootstrap(
            EXAMPLES / "kubernetes" / "pd-extproc.yaml"
        ),
        EXAMPLES / "envoy-gateway" / "prefill-envoy.yaml": render_yaml(
            prefill_only_envoy(EXAMPLES / "envoy-gateway" / "pd-extproc.yaml")
        ),
        EXAMPLES / "istio" / "envoyfilter.yaml": _dump(
            _ISTIO_HEADER, [istio_envoyfilter(EXAMPLES / "istio" / "pd-extproc.yaml")]
        ),
    }


def main(argv: list[str]) -> int:
    files = expected()
    stale = [path for path, text in files.items() if _read(path) != text]
    if "--check" in argv:
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run: python envoy/regenerate.py)")
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
