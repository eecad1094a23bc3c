"""The Helm chart rendered with `helm template`, per mode or as the gateway-api-inference
example's release, and what a test reads in it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from extproc.config import Config, parse_config
from tests.support.deploy import ROOT, one

CHART = ROOT / "deploy" / "helm" / "pd-extproc"


NAMESPACE = "llm"


MODES = ["gateway", "epp"]


CORE_KINDS = {
    "ConfigMap",
    "Deployment",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "NetworkPolicy",
    "PodDisruptionBudget",
}


def helm(kube_bin: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(kube_bin / "helm"), *args], capture_output=True, text=True, timeout=60, check=False
    )


# The gateway's pods an epp release's NetworkPolicy (on by default) must name.
EPP_PEERS = {"networkPolicy.extprocFrom[0].podSelector.matchLabels.gateway": "llm"}


def render(kube_bin: Path, mode: str, **values: str) -> list[dict[str, Any]]:
    """`helm template` in `mode`; an epp release names EPP_PEERS unless `values` say otherwise."""
    peers = EPP_PEERS if mode == "epp" and not any("networkPolicy" in k for k in values) else {}
    sets = [f"--set={key}={value}" for key, value in {"mode": mode, **peers, **values}.items()]
    result = helm(kube_bin, "template", "llm", str(CHART), "--namespace", NAMESPACE, *sets)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def chart_config(docs: list[dict[str, Any]]) -> Config:
    text = one(docs, "ConfigMap")["data"]["pd-extproc.yaml"]
    return parse_config(yaml.safe_load(text), "the chart's ConfigMap")


def container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    [found] = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
    return found


EXAMPLE = ROOT / "examples" / "gateway-api-inference"


def values_files(gateway: str) -> list[Path]:
    extra = EXAMPLE / gateway / "values.yaml"
    return [EXAMPLE / "values.yaml", *([extra] if extra.exists() else [])]


def release(kube_bin: Path, gateway: str, **values: str) -> list[dict[str, Any]]:
    files = [f"--values={path}" for path in values_files(gateway)]
    sets = [f"--set={key}={value}" for key, value in values.items()]
    result = helm(kube_bin, "template", "llm", str(CHART), "--namespace", NAMESPACE, *files, *sets)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
