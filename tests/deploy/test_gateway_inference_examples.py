"""examples/gateway-api-inference: the Helm release (the chart with values.yaml, plus the
gateway's own values) and each gateway's kustomization fit together: the InferencePool selects
exactly the engine pods, at their port; pd-extproc's role split puts every engine Deployment in
the pool of its role; the release's HTTPRoute attaches to the Gateway of the build; Istio gets
its DestinationRule; Envoy Gateway's values make InferencePool v1 a backend kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.roles import Role
from tests.support.deploy import by_kind, one
from tests.support.examples import build
from tests.support.helm import CHART, EXAMPLE, NAMESPACE, chart_config, helm, release, values_files

GATEWAYS = {"envoy-gateway": "eg", "istio": "istio", "kgateway": "kgateway"}


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_release_values_lint(kube_bin: Path, gateway: str) -> None:
    files = [f"--values={path}" for path in values_files(gateway)]
    result = helm(kube_bin, "lint", "--strict", str(CHART), *files)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_pool_selects_the_engines_and_splits_them_by_role(kube_bin: Path, gateway: str) -> None:
    docs = release(kube_bin, gateway)
    pool = one(docs, "InferencePool")["spec"]
    cfg = chart_config(docs)
    engines = by_kind(build(kube_bin, f"gateway-api-inference/{gateway}"), "Deployment")
    assert {d["metadata"]["name"] for d in engines} == {"vllm-prefill", "vllm-decode"}
    for deployment in engines:
        template = deployment["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert pool["selector"]["matchLabels"].items() <= labels.items()
        [engine] = template["spec"]["containers"]
        assert [p["number"] for p in pool["targetPorts"]] == [
            p["containerPort"] for p in engine["ports"]
        ]
        role = Role.PREFILL if deployment["metadata"]["name"] == "vllm-prefill" else Role.DECODE
        for each, pool_config in ((Role.PREFILL, cfg.prefill), (Role.DECODE, cfg.decode)):
            source = pool_config.inference_pool
            assert (
                source is not None and source.name == one(docs, "InferencePool")["metadata"]["name"]
            )
            assert source.takes(each, labels) == (each == role), (deployment["metadata"], each)


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_route_attaches_to_the_gateway_of_the_build(kube_bin: Path, gateway: str) -> None:
    [built] = by_kind(build(kube_bin, f"gateway-api-inference/{gateway}"), "Gateway")
    assert built["spec"]["gatewayClassName"] == GATEWAYS[gateway]
    route = one(release(kube_bin, gateway), "HTTPRoute")["spec"]
    [parent] = route["parentRefs"]
    assert parent["name"] == built["metadata"]["name"]
    assert parent.get("namespace", NAMESPACE) == built["metadata"]["namespace"]
    [listener] = built["spec"]["listeners"]
    assert listener["allowedRoutes"]["namespaces"]["from"] == "Same"


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_only_istio_gets_a_destination_rule(kube_bin: Path, gateway: str) -> None:
    rules = by_kind(release(kube_bin, gateway), "DestinationRule")
    assert len(rules) == (gateway == "istio")


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_picker_sends_one_address_for_an_original_dst_route(kube_bin: Path, gateway: str) -> None:
    assert chart_config(release(kube_bin, gateway)).endpoint_picker.fallbacks == 0


def test_envoy_gateway_values_make_inferencepool_v1_a_backend() -> None:
    values = yaml.safe_load((EXAMPLE / "envoy-gateway" / "envoy-gateway-values.yaml").read_text())
    manager = values["config"]["envoyGateway"]["extensionManager"]
    assert {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "version": "v1",
    } in manager["backendResources"]
    assert manager["service"]["fqdn"]["hostname"].endswith(".svc.cluster.local")
