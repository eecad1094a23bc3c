"""examples/ on Kubernetes, beyond schema validity: every pd-extproc container answers its
probes on paths the sidecar serves, every container drains before it exits, each pod's
termination grace covers the longest generation its config lets finish (`timeouts.drain_s`),
and an ext_proc that listens off loopback speaks TLS to the gateway's Envoys only.

The preStop hooks themselves run against a real Envoy in tests/integration/test_example_hooks.py.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import pytest
import yaml

from extproc.process.server import LIVE_PATH, READY_PATH
from tests.support.deploy import by_kind, documents
from tests.support.examples import (
    EXAMPLES,
    KUSTOMIZATIONS,
    config,
    container,
    hook_command,
    kustomized,
    pod,
    seconds,
    sidecar_paths,
)

ISTIO_ADMIN_PORT = 15000  # the admin port of Istio's Envoy, inside the gateway pod


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("example", KUSTOMIZATIONS)
def test_extproc_probes_ready_and_live_on_the_metrics_port(example: str) -> None:
    cfg = config(example)
    extproc = container(example, "pd-extproc")
    ready, live = extproc["readinessProbe"]["httpGet"], extproc["livenessProbe"]["httpGet"]
    assert (ready["path"], live["path"]) == (READY_PATH, LIVE_PATH)
    assert {READY_PATH, LIVE_PATH} <= sidecar_paths(cfg)
    ports = {p["name"]: p["containerPort"] for p in extproc["ports"]}
    assert ports[ready["port"]] == ports[live["port"]] == cfg.metrics.port


@pytest.mark.parametrize("example", KUSTOMIZATIONS)
def test_every_container_has_a_prestop_hook(example: str) -> None:
    for deploy in by_kind(kustomized(example), "Deployment"):
        for each in deploy["spec"]["template"]["spec"]["containers"]:
            if each.get("image") == "auto":  # istio-proxy: Istio's agent drains it on SIGTERM
                continue
            assert each.get("lifecycle", {}).get("preStop"), (example, each["name"])


def _before_draining_s(example: str) -> float:
    """How long each pod keeps taking new requests after its deletion, before the drain."""
    if example == "kubernetes":
        return float(flag(container(example, "envoy")["command"], "--drain-time-s"))
    if example == "istio":
        proxy = yaml.safe_load(pod(example)["metadata"]["annotations"]["proxy.istio.io/config"])
        return seconds(proxy["proxyMetadata"]["MINIMUM_DRAIN_DURATION"])
    return float(container(example, "pd-extproc")["lifecycle"]["preStop"]["sleep"]["seconds"])


@pytest.mark.parametrize("example", KUSTOMIZATIONS)
def test_termination_grace_covers_the_longest_generation(example: str) -> None:
    grace = pod(example)["spec"]["terminationGracePeriodSeconds"]
    assert grace >= _before_draining_s(example) + config(example).timeouts.drain_s
    assert config(example).timeouts.drain_s >= 600  # the examples let 10-minute generations end


def _ingress_stat_prefix() -> str:
    bootstrap = yaml.safe_load((EXAMPLES / "kubernetes" / "envoy.yaml").read_text())
    [ingress] = [x for x in bootstrap["static_resources"]["listeners"] if x["name"] == "ingress"]
    return str(ingress["filter_chains"][0]["filters"][0]["typed_config"]["stat_prefix"])


def test_kubernetes_envoy_hook_drains_the_ingress_through_the_configured_admin_port() -> None:
    admin = config("kubernetes").envoy.admin
    command = container("kubernetes", "envoy")["command"]
    assert flag(command, "--drain-strategy") == "immediate"
    shell, dash_c, script = hook_command("kubernetes", "envoy")
    assert (shell, dash_c) == ("/bin/bash", "-c")
    assert f"/dev/tcp/{admin.host}/{admin.port}" in script
    assert "'/drain_listeners?graceful&inboundonly'" in script
    assert f"http.{_ingress_stat_prefix()}.downstream_rq_active" in script
    assert f'("127.0.0.1", {admin.port})' in hook_command("kubernetes", "pd-extproc")[2]


def test_istio_extproc_outlives_istio_proxy() -> None:
    proxy = yaml.safe_load(pod("istio")["metadata"]["annotations"]["proxy.istio.io/config"])
    assert proxy["proxyMetadata"]["EXIT_ON_ZERO_ACTIVE_CONNECTIONS"] == "true"
    assert f'("127.0.0.1", {ISTIO_ADMIN_PORT})' in hook_command("istio", "pd-extproc")[2]


def test_envoy_gateway_prefill_envoy_outlives_the_extproc() -> None:
    port = config("envoy-gateway").metrics.port
    assert f"/dev/tcp/127.0.0.1/{port}" in hook_command("envoy-gateway", "prefill-envoy")[2]


# --- who reaches the ext_proc -----------------------------------------------------------------


@pytest.mark.parametrize("example", ["plain-envoy", *KUSTOMIZATIONS])
def test_an_extproc_off_loopback_speaks_tls(example: str) -> None:
    host = config(example).extproc.host
    if not host.startswith("unix:") and not ipaddress.ip_address(host).is_loopback:
        assert config(example).extproc.tls is not None, example


def _eg_security(kind: str) -> dict[str, Any]:
    [doc] = by_kind(documents(EXAMPLES / "envoy-gateway" / "extproc-security.yaml"), kind)
    return doc


def _eg_gateway(kind: str) -> dict[str, Any]:
    [doc] = by_kind(documents(EXAMPLES / "envoy-gateway" / "gateway.yaml"), kind)
    return doc


def _eg_extproc_service() -> dict[str, Any]:
    services = by_kind(kustomized("envoy-gateway"), "Service")
    [service] = [s for s in services if s["metadata"]["name"] == "pd-extproc"]
    return service


def test_envoy_gateway_tls_certificate_is_mounted_where_the_config_reads_it() -> None:
    tls = config("envoy-gateway").extproc.tls
    assert tls is not None
    certificate = _eg_security("Certificate")["spec"]
    assert tls.server_name in certificate["dnsNames"]
    volumes = {v["name"]: v for v in pod("envoy-gateway")["spec"]["volumes"]}
    mounts = {
        m["mountPath"]: volumes[m["name"]]
        for m in container("envoy-gateway", "pd-extproc")["volumeMounts"]
    }
    for path in (tls.cert_file, tls.key_file, tls.ca_file):
        directory, _, name = path.rpartition("/")
        assert mounts[directory]["secret"]["secretName"] == certificate["secretName"], path
        assert name in ("tls.crt", "tls.key", "ca.crt")  # the keys cert-manager writes


def test_envoy_gateway_dials_the_extproc_over_tls() -> None:
    tls = config("envoy-gateway").extproc.tls
    assert tls is not None
    policy = _eg_security("BackendTLSPolicy")
    assert policy["apiVersion"] == "gateway.networking.k8s.io/v1"
    service = _eg_extproc_service()
    port = config("envoy-gateway").extproc.port
    [grpc] = [p for p in service["spec"]["ports"] if p["port"] == port]
    assert policy["spec"]["targetRefs"] == [
        {
            "group": "",
            "kind": "Service",
            "name": service["metadata"]["name"],
            "sectionName": grpc["name"],
        }
    ]
    assert grpc.get("appProtocol") != "kubernetes.io/h2c"  # TLS, not HTTP/2 cleartext
    validation = policy["spec"]["validation"]
    assert validation["hostname"] == tls.server_name
    secret = _eg_security("Certificate")["spec"]["secretName"]
    assert validation["caCertificateRefs"] == [{"group": "", "kind": "Secret", "name": secret}]


def test_envoy_gateway_networkpolicy_admits_only_the_gateway_and_prometheus() -> None:
    cfg = config("envoy-gateway")
    policy = _eg_security("NetworkPolicy")["spec"]
    labels = pod("envoy-gateway", "pd-extproc")["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    extproc = container("envoy-gateway", "pd-extproc")
    ports = {p["name"]: p["containerPort"] for p in extproc["ports"]}
    rules = {}
    for rule in policy["ingress"]:
        assert rule.get("from"), "a rule without `from` admits everyone"
        [port] = rule["ports"]
        rules[ports[port["port"]]] = rule["from"]
    assert set(rules) == {cfg.extproc.port, cfg.metrics.port}
    [gateway_pods] = rules[cfg.extproc.port]
    gateway = _eg_gateway("Gateway")
    kustomization = yaml.safe_load((EXAMPLES / "envoy-gateway" / "kustomization.yaml").read_text())
    namespace = kustomization["namespace"]
    assert gateway_pods["podSelector"]["matchLabels"] == {
        "gateway.envoyproxy.io/owning-gateway-name": gateway["metadata"]["name"],
        "gateway.envoyproxy.io/owning-gateway-namespace": namespace,
    }


def test_envoy_gateway_envoys_drain_for_the_longest_generation() -> None:
    proxy = _eg_gateway("EnvoyProxy")
    reference = _eg_gateway("Gateway")["spec"]["infrastructure"]["parametersRef"]
    assert reference == {
        "group": "gateway.envoyproxy.io",
        "kind": "EnvoyProxy",
        "name": proxy["metadata"]["name"],
    }
    drain = proxy["spec"]["shutdown"]["drainTimeout"]
    assert re.fullmatch(r"\d+s", drain), drain
    assert seconds(drain) >= config("envoy-gateway").timeouts.drain_s
