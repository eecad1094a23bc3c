"""deploy/helm/pd-extproc: `helm lint` and `helm template` in both modes, and checks on the
rendered objects: the config in the ConfigMap loads with the sidecar's own loader and every
port, probe and TLS file of the pods comes from it; RBAC lets discovery watch pods and
InferencePools; the InferencePool's endpoint picker is the Service that serves the ext_proc;
Envoy's bootstrap, rendered by the init container's own command, passes `envoy --mode validate`.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.config import PoolConfig
from extproc.process.grpc_health import LIVENESS, READINESS
from extproc.process.server import LIVE_PATH, READY_PATH
from tests.support.deploy import K8S_VERSION, by_kind, envoy_validate, one
from tests.support.examples import sidecar_paths
from tests.support.helm import (
    CHART,
    CORE_KINDS,
    EPP_PEERS,
    MODES,
    NAMESPACE,
    chart_config,
    container,
    helm,
    render,
)

# Everything optional switched on, so that every template is rendered and checked.
EVERYTHING = {
    "httpRoute.create": "true",
    "istio.destinationRule.create": "true",
    "metrics.serviceMonitor.create": "true",
    "tls.certManager.issuerRef.name": "my-ca",
    "networkPolicy.create": "true",
    "networkPolicy.extprocFrom[0].podSelector.matchLabels.gateway": "llm",
    "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name": "monitoring",
}


def ports(each: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in each["ports"]}


@pytest.fixture(scope="module", params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def docs(kube_bin: Path, mode: str) -> list[dict[str, Any]]:
    return render(kube_bin, mode, **EVERYTHING)


def test_chart_lints_in_each_mode(kube_bin: Path, mode: str) -> None:
    sets = [f"--set={key}={value}" for key, value in EVERYTHING.items()]
    result = helm(kube_bin, "lint", "--strict", str(CHART), f"--set=mode={mode}", *sets)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_unknown_mode_is_refused_in_one_line(kube_bin: Path) -> None:
    result = helm(kube_bin, "template", "llm", str(CHART), "--set=mode=sidecar")
    assert result.returncode != 0
    assert "at '/mode': value must be one of 'gateway', 'epp'" in result.stderr  # the schema
    unchecked = helm(
        kube_bin, "template", "llm", str(CHART), "--set=mode=sidecar", "--skip-schema-validation"
    )
    assert 'mode must be gateway or epp (got "sidecar")' in unchecked.stderr  # the template


def test_core_resources_validate_against_kubernetes_schemas(docs: list[dict[str, Any]]) -> None:
    kinds = set()
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            kinds.add(doc["kind"])
    assert kinds == CORE_KINDS


def test_every_object_is_in_the_release_namespace(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        assert doc["metadata"].get("namespace") == NAMESPACE, (doc["kind"], doc["metadata"])


def test_config_in_the_configmap_loads_and_finds_the_engines(
    docs: list[dict[str, Any]], mode: str
) -> None:
    cfg = chart_config(docs)
    command = container(docs, "pd-extproc")["command"]
    assert command[:2] == ["pd-extproc", {"gateway": "serve", "epp": "epp"}[mode]]
    # the product's default routing, cache- and load-aware, as for any other user
    assert cfg.prefill.policy == cfg.decode.policy == "kv_cache"
    assert cfg.decision.mode == "load_aware"
    if mode == "gateway":  # the engine pods by label, the ext_proc inside the pod
        for role, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            assert pool.kubernetes is not None and pool.kubernetes.namespace == NAMESPACE
            assert (
                pool.kubernetes.label_selector
                == f"llm-d.ai/inferenceServing=true,llm-d.ai/role={role}"
            )
            assert pool.kubernetes.port == 8000
        assert cfg.extproc.host == "127.0.0.1"
        return
    pool = one(docs, "InferencePool")  # the pods of the pool this release picks for
    for each in (cfg.prefill, cfg.decode):
        assert each.inference_pool is not None
        assert each.inference_pool.name == pool["metadata"]["name"]
        assert each.inference_pool.namespace == NAMESPACE
        assert each.inference_pool.role_label == "llm-d.ai/role"
    assert pool["spec"]["selector"]["matchLabels"] == {"llm-d.ai/inferenceServing": "true"}
    assert cfg.extproc.host == "0.0.0.0"


def test_a_pool_source_in_config_replaces_the_charts(kube_bin: Path) -> None:
    docs = render(kube_bin, "gateway", **{"config.prefill.dns": "vllm-prefill:8000"})
    cfg = chart_config(docs)
    assert cfg.prefill == PoolConfig(dns="vllm-prefill:8000")
    assert cfg.decode.kubernetes is not None


def test_config_values_win_over_the_charts_defaults(kube_bin: Path) -> None:
    docs = render(
        kube_bin,
        "epp",
        **{
            "config.extproc.port": "9002",
            "config.decode.inference_pool.name": "other",
            "config.decode.inference_pool.namespace": "engines",
            "tls.secretName": "mine",
        },
    )
    cfg = chart_config(docs)
    assert cfg.extproc.port == 9002 and cfg.extproc.tls is not None
    assert cfg.decode.inference_pool is not None
    assert (cfg.decode.inference_pool.name, cfg.decode.inference_pool.namespace) == (
        "other",
        "engines",
    )
    assert ports(container(docs, "pd-extproc"))["grpc"] == 9002
    pool = one(docs, "InferencePool")["spec"]["endpointPickerRef"]
    assert pool["port"]["number"] == 9002


def test_probes_ask_what_the_sidecar_serves(docs: list[dict[str, Any]], mode: str) -> None:
    """gateway: HTTP /ready and /live on the metrics port; epp: the protocol's gRPC health
    services on the plaintext health port that `pd-extproc epp` opens."""
    cfg = chart_config(docs)
    extproc = container(docs, "pd-extproc")
    ready, live = extproc["readinessProbe"], extproc["livenessProbe"]
    if mode == "gateway":
        assert (ready["httpGet"]["path"], live["httpGet"]["path"]) == (READY_PATH, LIVE_PATH)
        assert {READY_PATH, LIVE_PATH} <= sidecar_paths(cfg)
        port = ports(extproc)[ready["httpGet"]["port"]]
        assert port == ports(extproc)[live["httpGet"]["port"]] == cfg.metrics.port
    else:
        assert (ready["grpc"]["service"], live["grpc"]["service"]) == (READINESS, LIVENESS)
        health = cfg.endpoint_picker.health_port
        assert ready["grpc"]["port"] == live["grpc"]["port"] == health
        assert health in ports(extproc).values() and health != cfg.extproc.port
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(cfg.metrics.port)
    service_ports = one(docs, "Service")["spec"]["ports"]
    for monitor in one(docs, "ServiceMonitor")["spec"]["endpoints"]:  # gateway: + Envoy's stats
        [metrics] = [p for p in service_ports if p["name"] == monitor["port"]]
        assert ports(extproc)[metrics["targetPort"]] == cfg.metrics.port


def test_rbac_lets_discovery_watch_pods_and_inferencepools(docs: list[dict[str, Any]]) -> None:
    rules = {
        (group, resource): set(rule["verbs"])
        for rule in one(docs, "Role")["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("", "pods"): {"get", "list", "watch"},
        ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"},
    }
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": one(docs, "Role")["metadata"]["name"],
    }
    account = one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    assert one(docs, "ServiceAccount")["metadata"]["name"] == account


def test_termination_grace_covers_the_longest_generation(
    docs: list[dict[str, Any]], mode: str
) -> None:
    cfg = chart_config(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    if mode == "gateway":
        command = container(docs, "envoy")["command"]
        before = float(command[command.index("--drain-time-s") + 1])
    else:
        before = float(container(docs, "pd-extproc")["lifecycle"]["preStop"]["sleep"]["seconds"])
    assert pod["terminationGracePeriodSeconds"] >= before + cfg.timeouts.drain_s
    for each in pod["containers"]:
        assert each["lifecycle"]["preStop"], each["name"]


# --- epp mode ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def epp(kube_bin: Path) -> list[dict[str, Any]]:
    return render(kube_bin, "epp", **EVERYTHING)


def test_inferencepool_picker_is_the_service_serving_the_extproc(
    epp: list[dict[str, Any]],
) -> None:
    pool = one(epp, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"]
    assert [p["number"] for p in spec["targetPorts"]] == [8000]
    picker = spec["endpointPickerRef"]
    assert picker["failureMode"] in ("FailOpen", "FailClose")
    assert picker["kind"] == "Service"
    service = one(epp, "Service")
    assert picker["name"] == service["metadata"]["name"]
    [grpc] = [p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"]]
    assert ports(container(epp, "pd-extproc"))[grpc["targetPort"]] == chart_config(epp).extproc.port
    labels = one(epp, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_httproute_and_istio_rule_point_at_the_pool_and_picker(epp: list[dict[str, Any]]) -> None:
    route = one(epp, "HTTPRoute")["spec"]
    [rule] = route["rules"]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": one(epp, "InferencePool")["metadata"]["name"],
        }
    ]
    paths = {m["path"]["value"] for m in rule["matches"]}
    assert paths == {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    service = one(epp, "Service")["metadata"]["name"]
    rule_spec = one(epp, "DestinationRule")["spec"]
    assert rule_spec["host"] == f"{service}.{NAMESPACE}.svc.cluster.local"
    [port] = rule_spec["trafficPolicy"]["portLevelSettings"]
    assert port["port"]["number"] == chart_config(epp).extproc.port
    assert port["tls"]["mode"] == "SIMPLE"


def test_epp_serves_tls_with_the_mounted_certificate(epp: list[dict[str, Any]]) -> None:
    tls = chart_config(epp).extproc.tls
    assert tls is not None
    certificate = one(epp, "Certificate")["spec"]
    assert tls.server_name in certificate["dnsNames"]
    pod = one(epp, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {
        m["mountPath"]: volumes[m["name"]] for m in container(epp, "pd-extproc")["volumeMounts"]
    }
    for path in (tls.cert_file, tls.key_file, tls.ca_file):
        directory, _, name = path.rpartition("/")
        assert mounts[directory]["secret"]["secretName"] == certificate["secretName"], path
        assert name in ("tls.crt", "tls.key", "ca.crt")


def test_epp_without_a_certificate_serves_a_self_signed_one(kube_bin: Path) -> None:
    docs = render(kube_bin, "epp")
    assert chart_config(docs).extproc.tls is None
    assert chart_config(docs).endpoint_picker.secure_serving
    assert not by_kind(docs, "Certificate")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert all("secret" not in volume for volume in pod["volumes"])


def test_epp_networkpolicy_admits_only_the_given_peers(epp: list[dict[str, Any]]) -> None:
    policy = one(epp, "NetworkPolicy")["spec"]
    named = ports(container(epp, "pd-extproc"))
    admitted = {named[rule["ports"][0]["port"]]: rule["from"] for rule in policy["ingress"]}
    cfg = chart_config(epp)
    assert admitted == {
        cfg.extproc.port: [{"podSelector": {"matchLabels": {"gateway": "llm"}}}],
        cfg.metrics.port: [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
    }


def test_epp_ships_its_networkpolicy_on_by_default(kube_bin: Path) -> None:
    """Whoever reaches the picker's port can have P legs sent: by default only the gateway's
    pods may (the metrics port stays open to any peer unless metricsFrom names some)."""
    docs = render(kube_bin, "epp", **EPP_PEERS)
    policy = one(docs, "NetworkPolicy")["spec"]
    named = ports(container(docs, "pd-extproc"))
    cfg = chart_config(docs)
    rules = {named[rule["ports"][0]["port"]]: rule.get("from") for rule in policy["ingress"]}
    assert rules == {
        cfg.extproc.port: [{"podSelector": {"matchLabels": {"gateway": "llm"}}}],
        cfg.metrics.port: None,
    }
    assert policy["policyTypes"] == ["Ingress"]
    assert not by_kind(render(kube_bin, "gateway"), "NetworkPolicy")  # its ext_proc: loopback


def test_epp_without_the_gateways_pods_is_refused_in_one_line(kube_bin: Path) -> None:
    """An empty `from` would admit every peer."""
    result = helm(kube_bin, "template", "llm", str(CHART), "--set=mode=epp")
    assert result.returncode != 0
    assert "networkPolicy.extprocFrom: the Gateway's Envoy pods" in result.stderr
    off = helm(
        kube_bin,
        "template",
        "llm",
        str(CHART),
        "--set=mode=epp",
        "--set=networkPolicy.create=false",
    )
    assert off.returncode == 0, off.stderr
    assert "kind: NetworkPolicy" not in off.stdout


# --- gateway mode -----------------------------------------------------------------------------


def test_gateway_envoy_bootstrap_from_the_init_container_validates(
    kube_bin: Path, tmp_path: Path
) -> None:
    """The init container's own command, run here on the ConfigMap's config, renders a bootstrap
    that Envoy accepts, at the path Envoy reads, with the ports the pod and its hooks use (set
    in `config`, away from the chart's defaults)."""
    moved = {"config.envoy.admin.port": "9911", "config.envoy.listen.port": "8080"}
    docs = render(kube_bin, "gateway", **moved)
    (tmp_path / "pd-extproc.yaml").write_text(one(docs, "ConfigMap")["data"]["pd-extproc.yaml"])
    shell, dash_c, script = container(docs, "render-envoy")["command"]
    assert (shell, dash_c) == ("sh", "-c")
    command, _, target = script.partition(" > ")
    envoy = container(docs, "envoy")
    assert target == envoy["command"][envoy["command"].index("-c") + 1]
    mounts = {m["name"]: m["mountPath"] for m in envoy["volumeMounts"]}
    assert Path(target).parent == Path(mounts["envoy-bootstrap"])
    argv = shlex.split(command.replace("/etc/pd-extproc/", f"{tmp_path}/"))
    argv[0] = str(Path(sys.executable).parent / argv[0])
    rendered = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    (tmp_path / "envoy.yaml").write_text(rendered.stdout)
    envoy_validate(tmp_path / "envoy.yaml")
    bootstrap = yaml.safe_load(rendered.stdout)
    cfg = chart_config(docs)
    listeners = {
        x["name"]: x["address"]["socket_address"]
        for x in bootstrap["static_resources"]["listeners"]
    }
    assert listeners["ingress"]["port_value"] == ports(envoy)["http"] == cfg.envoy.listen.port
    prefill = listeners["prefill"]
    assert f"{prefill['address']}:{prefill['port_value']}" == cfg.envoy.prefill_listener
    admin = bootstrap["admin"]["address"]["socket_address"]
    drain_hook = envoy["lifecycle"]["preStop"]["exec"]["command"][2]
    assert f"/dev/tcp/{admin['address']}/{admin['port_value']}" in drain_hook
    wait_hook = container(docs, "pd-extproc")["lifecycle"]["preStop"]["exec"]["command"][2]
    assert f'("{admin["address"]}", {admin["port_value"]})' in wait_hook


def test_gateway_service_reaches_envoy_and_keeps_the_extproc_inside(kube_bin: Path) -> None:
    docs = render(kube_bin, "gateway")
    service = one(docs, "Service")["spec"]
    targets = {p["name"]: p["targetPort"] for p in service["ports"]}
    assert targets["http"] == "http" and "http" in ports(container(docs, "envoy"))
    assert "grpc" not in targets and "grpc" not in ports(container(docs, "pd-extproc"))
    assert not by_kind(docs, "InferencePool")


# --- availability and pod extras ----------------------------------------------------------------


def pod_labels(docs: list[dict[str, Any]]) -> dict[str, str]:
    labels: dict[str, str] = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    return labels


def test_disruption_budget_covers_the_pods_one_at_a_time(docs: list[dict[str, Any]]) -> None:
    budget = one(docs, "PodDisruptionBudget")["spec"]
    assert budget["maxUnavailable"] == 1 and "minAvailable" not in budget
    assert budget["selector"]["matchLabels"].items() <= pod_labels(docs).items()
    assert one(docs, "Deployment")["spec"]["replicas"] == 2


def test_disruption_budget_min_available_replaces_max_unavailable(kube_bin: Path) -> None:
    budget = one(
        render(kube_bin, "epp", **{"podDisruptionBudget.minAvailable": "50%"}),
        "PodDisruptionBudget",
    )["spec"]
    assert budget["minAvailable"] == "50%" and "maxUnavailable" not in budget
    assert not by_kind(
        render(kube_bin, "epp", **{"podDisruptionBudget.create": "false"}), "PodDisruptionBudget"
    )


def test_topology_spread_selects_the_releases_own_pods(kube_bin: Path) -> None:
    spread = {
        "topologySpreadConstraints[0].maxSkew": "1",
        "topologySpreadConstraints[0].topologyKey": "topology.kubernetes.io/zone",
        "topologySpreadConstraints[0].whenUnsatisfiable": "ScheduleAnyway",
        "topologySpreadConstraints[1].maxSkew": "2",
        "topologySpreadConstraints[1].topologyKey": "kubernetes.io/hostname",
        "topologySpreadConstraints[1].whenUnsatisfiable": "DoNotSchedule",
        "topologySpreadConstraints[1].labelSelector.matchLabels.tier": "gw",
    }
    docs = render(kube_bin, "gateway", **spread)
    zone, host = one(docs, "Deployment")["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert zone["topologyKey"] == "topology.kubernetes.io/zone" and zone["maxSkew"] == 1
    assert zone["labelSelector"]["matchLabels"].items() <= pod_labels(docs).items()
    assert host["labelSelector"] == {"matchLabels": {"tier": "gw"}}  # the user's own wins
    kubernetes_validate.validate(one(docs, "Deployment"), K8S_VERSION, strict=True)


def test_engine_api_key_secret_mounts_where_the_config_reads_it(kube_bin: Path, mode: str) -> None:
    """env, extraVolumes and extraVolumeMounts: the engines' API key from a Secret, at the path
    of `config.engines.api_key_file`, in every container that loads the config."""
    extras = {
        "extraVolumes[0].name": "engine-key",
        "extraVolumes[0].secret.secretName": "vllm-api-key",
        "extraVolumeMounts[0].name": "engine-key",
        "extraVolumeMounts[0].mountPath": "/etc/engine-key",
        "extraVolumeMounts[0].readOnly": "true",
        "config.engines.api_key_file": "/etc/engine-key/api-key",
        "env[0].name": "OTEL_SERVICE_NAME",
        "env[0].value": "pd-extproc",
    }
    docs = render(kube_bin, mode, **extras)
    key_file = yaml.safe_load(one(docs, "ConfigMap")["data"]["pd-extproc.yaml"])["engines"][
        "api_key_file"
    ]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    readers = ["pd-extproc", "render-envoy"] if mode == "gateway" else ["pd-extproc"]
    for name in readers:
        mounts = {m["mountPath"]: m["name"] for m in container(docs, name)["volumeMounts"]}
        directory = str(Path(key_file).parent)
        assert volumes[mounts[directory]]["secret"] == {"secretName": "vllm-api-key"}, name
    assert {"name": "OTEL_SERVICE_NAME", "value": "pd-extproc"} in container(docs, "pd-extproc")[
        "env"
    ]
    kubernetes_validate.validate(one(docs, "Deployment"), K8S_VERSION, strict=True)
