"""The examples/ folder: each example's pd-extproc config, its Kubernetes resources as
`kubectl apply -k` would create them, and the pods and containers in them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from extproc.config import Config, load_config
from extproc.process.server import ExtProcServer
from extproc.wiring import Runtime
from tests.support.deploy import (
    ROOT,
    by_kind,
    documents,
)

EXAMPLES = ROOT / "examples"


def config(example: str) -> Config:
    return load_config(EXAMPLES / example / "pd-extproc.yaml")


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert match, duration
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


KUSTOMIZATIONS = ["kubernetes", "istio", "envoy-gateway"]


def kustomized(example: str) -> list[dict[str, Any]]:
    """The resources `kubectl apply -k` would create, ConfigMaps built from their files."""
    folder = EXAMPLES / example
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs = [doc for name in kustomization["resources"] for doc in documents(folder / name)]
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for entry in generator["files"]:
            key, _, source = entry.rpartition("=") if "=" in entry else ("", "", entry)
            data[key or Path(source).name] = (folder / source).read_text()
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"]},
                "data": data,
            }
        )
    return docs


def deployment(example: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d
        for d in by_kind(kustomized(example), "Deployment")
        if name is None or d["metadata"]["name"] == name
    ]
    assert len(found) == 1, (example, name)
    return found[0]


def pod(example: str, name: str | None = None) -> dict[str, Any]:
    return deployment(example, name)["spec"]["template"]


def container(example: str, name: str, deployment_name: str | None = None) -> dict[str, Any]:
    [found] = [c for c in pod(example, deployment_name)["spec"]["containers"] if c["name"] == name]
    return found


def hook_command(example: str, name: str) -> list[str]:
    """The exec command of a container's preStop hook."""
    return list(container(example, name)["lifecycle"]["preStop"]["exec"]["command"])


def sidecar_paths(cfg: Config) -> set[str]:
    """The GET paths the sidecar's metrics port really serves."""
    app = ExtProcServer(Runtime(cfg, "127.0.0.1:10001"))._http_app()
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET"}


def build(kube_bin: Path, folder: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [str(kube_bin / "kubectl"), "kustomize", str(EXAMPLES / folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize examples/{folder}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
