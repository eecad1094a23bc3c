"""Every kustomization under examples/ through `kubectl kustomize` (offline; the kustomize built
into kubectl 1.33): it builds, every object lands in the kustomization's namespace, the pods
mount ConfigMaps and use ServiceAccounts that the same build creates (generated ConfigMaps get a
content hash in their name, which kustomize writes into the pods only when the names match),
RoleBindings bind a ServiceAccount of the build, and the core objects pass their schemas."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.support.deploy import K8S_VERSION, ROOT, by_kind
from tests.support.examples import build

EXAMPLES = ROOT / "examples"
FOLDERS = sorted(
    p.parent.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("kustomization.yaml")
)
CORE_KINDS = {
    "ConfigMap",
    "Deployment",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
    "Secret",
}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "GatewayClass", "Namespace"}


def namespace_of(folder: str) -> str | None:
    kustomization = yaml.safe_load((EXAMPLES / folder / "kustomization.yaml").read_text())
    return kustomization.get("namespace")


def test_every_kustomization_is_found() -> None:
    assert {"kubernetes", "istio", "envoy-gateway"} <= set(FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_kustomization_builds_into_one_namespace(kube_bin: Path, folder: str) -> None:
    docs = build(kube_bin, folder)
    assert docs
    namespace = namespace_of(folder)
    assert namespace, f"examples/{folder}: the kustomization sets no namespace"
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"].get("namespace") == namespace, (
                doc["kind"],
                doc["metadata"]["name"],
            )


@pytest.mark.parametrize("folder", FOLDERS)
def test_pods_refer_to_objects_of_the_same_build(kube_bin: Path, folder: str) -> None:
    docs = build(kube_bin, folder)
    config_maps = {d["metadata"]["name"] for d in by_kind(docs, "ConfigMap")}
    accounts = {d["metadata"]["name"] for d in by_kind(docs, "ServiceAccount")}
    for deployment in by_kind(docs, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, (folder, volume)
        account = pod.get("serviceAccountName")
        if account is not None:
            assert account in accounts, (folder, deployment["metadata"]["name"], account)
    for binding in by_kind(docs, "RoleBinding"):
        for subject in binding["subjects"]:
            if subject["kind"] == "ServiceAccount":
                assert subject["name"] in accounts, (folder, binding["metadata"]["name"])
        roles = {d["metadata"]["name"] for d in by_kind(docs, binding["roleRef"]["kind"])}
        assert binding["roleRef"]["name"] in roles, (folder, binding["roleRef"])


@pytest.mark.parametrize("folder", FOLDERS)
def test_core_objects_of_the_build_validate(kube_bin: Path, folder: str) -> None:
    for doc in build(kube_bin, folder):
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
