"""examples/: every Envoy configuration passes `envoy --mode validate`, every Kubernetes core
resource validates against its schema (kubernetes-validate, bundled schemas, offline), and the
custom resources (Istio, Gateway API, Envoy Gateway), for which no schema package works offline,
get structural checks plus cross-checks against the pd-extproc config they are made for."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.headers import DESTINATION_HEADER
from extproc.protocol.bodies import buffer_bytes
from tests.support.deploy import (
    K8S_VERSION,
    ROOT,
    by_kind,
    documents,
    envoy_validate,
    envoy_validate_dict,
)
from tests.support.examples import EXAMPLES, KUSTOMIZATIONS, config, kustomized, seconds

GOLDEN = ROOT / "envoy"
CORE_KINDS = {
    "ConfigMap",
    "Deployment",
    "NetworkPolicy",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
}


def regenerate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("regenerate", GOLDEN / "regenerate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_files_are_current() -> None:
    stale = [
        str(path.relative_to(ROOT))
        for path, text in regenerate().expected().items()
        if not path.exists() or path.read_text() != text
    ]
    assert not stale, f"stale (run: python envoy/regenerate.py): {stale}"


@pytest.mark.parametrize(
    "path",
    [
        "envoy/bootstrap.yaml",
        "examples/kubernetes/envoy.yaml",
        "examples/envoy-gateway/prefill-envoy.yaml",
    ],
)
def test_envoy_bootstraps_validate(path: str) -> None:
    envoy_validate(ROOT / path)


def _hcm_listener(
    name: str, port: int, filters: list[Any], vhosts: list[Any], **merged: Any
) -> dict:
    hcm = {
        **merged,
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "route_config": {"name": name, "virtual_hosts": vhosts},
        "http_filters": [
            *filters,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def _bootstrap(listeners: list[Any], clusters: list[Any]) -> dict[str, Any]:
    return {"static_resources": {"listeners": listeners, "clusters": clusters}}


def test_snippet_pasted_into_an_existing_envoy_validates(tmp_path: Path) -> None:
    snippet = yaml.safe_load((GOLDEN / "snippet.yaml").read_text())
    assert set(snippet) == {
        "node",
        "http_connection_manager",
        "http_filters",
        "routes",
        "every_other_route",
        "clusters",
        "listeners",
    }
    assert [c["name"] for c in snippet["clusters"]] == ["pd_extproc", "decode_pool", "prefill_pool"]
    assert [f["name"] for f in snippet["http_filters"]] == ["envoy.filters.http.ext_proc"]
    # the user's own listener with the snippet's routes first, then one of their own
    mine = {
        "match": {"prefix": "/"},
        "direct_response": {"status": 200},
        **snippet["every_other_route"],
    }
    vhost = {"name": "mine", "domains": ["*"], "routes": [*snippet["routes"], mine]}
    listener = _hcm_listener(
        "my_ingress", 8080, snippet["http_filters"], [vhost], **snippet["http_connection_manager"]
    )
    bootstrap = _bootstrap([listener, *snippet["listeners"]], snippet["clusters"])
    bootstrap["node"] = snippet["node"]
    envoy_validate_dict(bootstrap, tmp_path, "existing-envoy")


def test_snippet_header_says_where_each_piece_goes() -> None:
    header = [
        line for line in (GOLDEN / "snippet.yaml").read_text().splitlines() if line.startswith("#")
    ]
    text = "\n".join(header)
    for where in (
        "http_filters:",
        "http_connection_manager:",
        "clusters:",
        "listeners:",
        "routes:",
        "every_other_route:",
        "loopback",
        "exact path",
    ):
        assert where in text


# --- Istio -------------------------------------------------------------------------------


def _envoyfilter() -> dict[str, Any]:
    [envoyfilter] = documents(EXAMPLES / "istio" / "envoyfilter.yaml")
    return envoyfilter


def _patches(apply_to: str) -> list[dict[str, Any]]:
    return [p for p in _envoyfilter()["spec"]["configPatches"] if p["applyTo"] == apply_to]


def test_istio_envoyfilter_patches_assemble_into_a_valid_envoy(tmp_path: Path) -> None:
    [ext_proc] = [p["patch"]["value"] for p in _patches("HTTP_FILTER")]
    [vhost] = [p["patch"]["value"] for p in _patches("VIRTUAL_HOST")]
    clusters = [p["patch"]["value"] for p in _patches("CLUSTER")]
    listeners = [p["patch"]["value"] for p in _patches("LISTENER")]
    [hcm] = [p["patch"]["value"]["typed_config"] for p in _patches("NETWORK_FILTER")]
    gateway = _hcm_listener(
        "gateway_8080", 8080, [ext_proc], [vhost], **{k: v for k, v in hcm.items() if k != "@type"}
    )
    envoy_validate_dict(_bootstrap([gateway, *listeners], clusters), tmp_path, "istio")


def test_istio_envoyfilter_structure() -> None:
    envoyfilter = _envoyfilter()
    assert envoyfilter["apiVersion"] == "networking.istio.io/v1alpha3"
    for patch in envoyfilter["spec"]["configPatches"]:
        assert patch["match"]["context"] == "GATEWAY"
        assert patch["patch"]["operation"] in {"ADD", "INSERT_BEFORE", "MERGE"}
    [http_filter] = _patches("HTTP_FILTER")
    assert http_filter["patch"]["operation"] == "INSERT_BEFORE"
    [hcm] = _patches("NETWORK_FILTER")
    assert hcm["patch"]["operation"] == "MERGE"
    assert hcm["match"]["listener"] == http_filter["match"]["listener"] | {
        "filterChain": {"filter": {"name": "envoy.filters.network.http_connection_manager"}}
    }
    assert hcm["patch"]["value"]["typed_config"]["normalize_path"] is True
    sub = http_filter["match"]["listener"]["filterChain"]["filter"]["subFilter"]
    assert sub["name"] == "envoy.filters.http.router"
    [listener] = [p["patch"]["value"] for p in _patches("LISTENER")]
    address = listener["address"]["socket_address"]
    assert (address["address"], address["port_value"]) == ("127.0.0.1", 10001)


def test_istio_gateway_matches_the_envoyfilter() -> None:
    docs = documents(EXAMPLES / "istio" / "gateway.yaml")
    [deployment], [service], [gateway] = (
        by_kind(docs, k) for k in ("Deployment", "Service", "Gateway")
    )
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = _envoyfilter()["spec"]["workloadSelector"]["labels"]
    assert selector.items() <= pod_labels.items()
    assert gateway["spec"]["selector"].items() <= pod_labels.items()
    [server] = gateway["spec"]["servers"]
    [routes] = _patches("VIRTUAL_HOST")
    assert routes["match"]["routeConfiguration"]["portNumber"] == server["port"]["number"]
    [port] = service["spec"]["ports"]
    [http_filter] = _patches("HTTP_FILTER")
    assert http_filter["match"]["listener"]["portNumber"] == port["targetPort"]
    assert port["port"] == server["port"]["number"]
    assert set(server["hosts"]) <= set(routes["patch"]["value"]["domains"])
    assert any(
        c["name"] == "istio-proxy" for c in deployment["spec"]["template"]["spec"]["containers"]
    )


# --- Envoy Gateway ---------------------------------------------------------------------------


def _eg(kind: str) -> dict[str, Any]:
    [doc] = by_kind(documents(EXAMPLES / "envoy-gateway" / "gateway.yaml"), kind)
    return doc


def test_envoy_gateway_resources_match_the_config() -> None:
    cfg = config("envoy-gateway")
    decode = _eg("Service")  # the decode pods: the pods pd-extproc watches
    source = cfg.decode.kubernetes
    assert source is not None
    selector = ",".join(f"{k}={v}" for k, v in decode["spec"]["selector"].items())
    assert selector == source.label_selector
    [port] = decode["spec"]["ports"]
    assert port["targetPort"] == source.port
    [rule] = _eg("HTTPRoute")["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": decode["metadata"]["name"], "port": port["port"]}]
    assert {m["path"]["value"] for m in rule["matches"]} == {
        "/v1/completions",
        "/v1/chat/completions",
    }
    [ext_proc] = _eg("EnvoyExtensionPolicy")["spec"]["extProc"]
    assert ext_proc["backendRefs"] == [{"name": "pd-extproc", "port": cfg.extproc.port}]
    assert ext_proc["processingMode"] == {"request": {"body": "Buffered"}, "response": {}}
    assert ext_proc["failOpen"] is False
    assert seconds(ext_proc["messageTimeout"]) > cfg.timeouts.prefill_s
    override = _eg("BackendTrafficPolicy")["spec"]["loadBalancer"]["endpointOverride"]
    assert override["extractFrom"] == [{"header": DESTINATION_HEADER}]
    limit = _eg("ClientTrafficPolicy")["spec"]["connection"]["bufferLimit"]
    assert _eg("ClientTrafficPolicy")["spec"]["path"]["escapedSlashesAction"] == "RejectRequest"
    assert _bytes(limit) >= buffer_bytes(cfg.limits.max_body_bytes)  # room for the splice
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy"):
        assert _eg(kind)["spec"]["targetRefs"][0]["name"] == _eg("HTTPRoute")["metadata"]["name"]


def test_envoy_gateway_extproc_service_serves_grpc() -> None:
    [service] = by_kind(
        documents(EXAMPLES / "envoy-gateway" / "extproc-deployment.yaml"), "Service"
    )
    [grpc] = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc["port"] == config("envoy-gateway").extproc.port


def _bytes(quantity: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity)
    assert match, quantity
    return int(match.group(1)) * {None: 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}[match.group(2)]


# --- Kubernetes manifests (all three Kubernetes examples) -----------------------------------

# Custom resources: (apiVersion, kind) → the spec fields their CRDs require.
CUSTOM_KINDS = {
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): ["configPatches"],
    ("networking.istio.io/v1", "Gateway"): ["selector", "servers"],
    ("gateway.networking.k8s.io/v1", "Gateway"): ["gatewayClassName", "listeners"],
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): ["parentRefs", "rules"],
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"): ["targetRefs", "extProc"],
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"): ["targetRefs"],
    ("gateway.envoyproxy.io/v1alpha1", "ClientTrafficPolicy"): ["targetRefs"],
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyProxy"): ["shutdown"],
    ("gateway.networking.k8s.io/v1", "BackendTLSPolicy"): ["targetRefs", "validation"],
    ("cert-manager.io/v1", "Certificate"): ["secretName", "dnsNames", "issuerRef"],
}


@pytest.mark.parametrize("example", KUSTOMIZATIONS)
def test_core_resources_validate_against_kubernetes_schemas(example: str) -> None:
    for doc in kustomized(example):
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("example", KUSTOMIZATIONS)
def test_custom_resources_have_the_required_structure(example: str) -> None:
    for doc in kustomized(example):
        if doc["kind"] in CORE_KINDS:
            continue
        required = CUSTOM_KINDS.get((doc["apiVersion"], doc["kind"]))
        assert required is not None, f"unknown resource {doc['apiVersion']} {doc['kind']}"
        assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", doc["metadata"]["name"]), doc
        missing = [key for key in required if not doc.get("spec", {}).get(key)]
        assert not missing, f"{doc['kind']} {doc['metadata']['name']}: spec lacks {missing}"


@pytest.mark.parametrize("example", KUSTOMIZATIONS)
def test_pods_mount_their_configs_where_the_commands_read_them(example: str) -> None:
    docs = kustomized(example)
    config_maps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    for deployment in by_kind(docs, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        volumes = {
            v["name"]: v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v
        }
        for container in pod["containers"]:
            mounts = {
                m["mountPath"]: volumes.get(m["name"]) for m in container.get("volumeMounts", [])
            }
            command = container.get("command", [])
            for flag in ("--config", "-c"):
                if flag in command:
                    path = Path(command[command.index(flag) + 1])
                    config_map = config_maps[mounts[str(path.parent)]]
                    assert path.name in config_map["data"], (example, container["name"])
            if "--prefill-listener" in command:
                listener = command[command.index("--prefill-listener") + 1]
                cfg = config(example)
                assert cfg.envoy.prefill_listener in ("", listener)
                assert listener == "127.0.0.1:10001"


@pytest.mark.parametrize("example", ["plain-envoy", *KUSTOMIZATIONS])
def test_pd_extproc_configs_load(example: str) -> None:
    cfg = config(example)
    for pool in (cfg.prefill, cfg.decode):
        assert pool.endpoints or pool.dns or pool.kubernetes or pool.inference_pool


def _namespaced(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


@pytest.mark.parametrize("example", KUSTOMIZATIONS)
def test_examples_discover_their_engines_with_the_rbac_they_ship(example: str) -> None:
    """No hand-picked addresses: the pools come from watched pods, and the pd-extproc pod's
    service account may get, list and watch pods and InferencePools in its namespace."""
    cfg, docs = config(example), kustomized(example)
    namespace = yaml.safe_load((EXAMPLES / example / "kustomization.yaml").read_text())["namespace"]
    for pool in (cfg.prefill, cfg.decode):
        assert not pool.endpoints and pool.kubernetes is not None
        assert pool.kubernetes.namespace == namespace
    assert not [s for s in _namespaced(docs, "Service") if "clusterIP" in s.get("spec", {})]
    pods = [d["spec"]["template"]["spec"] for d in _namespaced(docs, "Deployment")]
    [pod] = [p for p in pods if any(c["name"] == "pd-extproc" for c in p["containers"])]
    account = pod["serviceAccountName"]
    assert [a["metadata"]["name"] for a in _namespaced(docs, "ServiceAccount")] == [account]
    (binding,) = _namespaced(docs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    (role,) = [
        r for r in _namespaced(docs, "Role") if r["metadata"]["name"] == binding["roleRef"]["name"]
    ]
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    for wanted in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        assert granted[wanted] >= {"get", "list", "watch"}, wanted
