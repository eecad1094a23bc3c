"""deploy/helm/pd-extproc's values: one default image shared with docker-compose.yml and CI's
compose stage, and a values.schema.json that Helm itself enforces. A typo'd key or a wrong type
is refused by `helm lint` and `helm template`, before anything reaches a pod; the defaults and
every values file for this chart under examples/ are accepted, and what they render validates
against the Kubernetes schemas."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from scripts import chart_schema
from scripts.local_docker import PRODUCT_IMAGE
from tests.support.deploy import K8S_VERSION, ROOT
from tests.support.helm import CHART, CORE_KINDS, EPP_PEERS, MODES, container, helm, render

VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
# Values files under examples/ that belong to another project's chart, not to this one.
FOREIGN_VALUES = {"examples/gateway-api-inference/envoy-gateway/envoy-gateway-values.yaml"}
# An image reference to pd-extproc with a tag (not the base image, not "pd-extproc: ...").
IMAGE_REF = re.compile(r"(?<![\w-])pd-extproc:([A-Za-z0-9_][A-Za-z0-9_.-]*)")


def chart_values_files() -> list[str]:
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*values*.yaml")}
    assert found >= FOREIGN_VALUES, "FOREIGN_VALUES names a file that is gone"
    return sorted(found - FOREIGN_VALUES)


# --- the image --------------------------------------------------------------------------------


def test_one_default_image_for_the_chart_compose_and_ci(kube_bin: Path) -> None:
    """The chart's default (repository:appVersion, the package's version), the image that
    docker-compose.yml builds and runs, and the one scripts/local_docker.py builds for CI's
    compose stage are the same name."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version
    repository = yaml.safe_load(VALUES.read_text())["image"]["repository"]
    assert f"{repository}:{chart['appVersion']}" == PRODUCT_IMAGE
    for mode in MODES:
        assert container(render(kube_bin, mode), "pd-extproc")["image"] == PRODUCT_IMAGE
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    built = {name: s["image"] for name, s in services.items() if "build" in s}
    assert built and set(built.values()) == {PRODUCT_IMAGE}, built


@pytest.mark.parametrize("mode", MODES)
def test_install_notes_name_the_image_to_build(kube_bin: Path, mode: str) -> None:
    """`helm install --dry-run=client` (no API server here) renders NOTES.txt too."""
    result = helm(
        kube_bin,
        "install",
        "llm",
        str(CHART),
        "-n",
        "llm",
        "--dry-run=client",
        f"--set=mode={mode}",
        *(f"--set={key}={value}" for key, value in EPP_PEERS.items() if mode == "epp"),
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.partition("NOTES:")[2]
    assert f"Image: {PRODUCT_IMAGE} (build and push it" in notes, notes


def test_every_file_naming_the_image_names_the_default_tag() -> None:
    """Examples, Dockerfile, compose, scripts and tests: no second tag for the same image."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
    ).stdout.split()
    tag = PRODUCT_IMAGE.partition(":")[2]
    others = []
    for name in tracked:
        path = ROOT / name
        if path.suffix not in {"", ".yml", ".yaml", ".py", ".md", ".txt"}:
            continue
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            others += [
                f"{name}:{number}: {m.group(0)}"
                for m in IMAGE_REF.finditer(line)
                if m.group(1) != tag
            ]
    assert not others, f"image tags other than {PRODUCT_IMAGE}: {others}"


# --- the schema -------------------------------------------------------------------------------


def test_schema_is_current_with_the_sidecars_config_model() -> None:
    assert SCHEMA.read_text() == chart_schema.expected(), "run: python scripts/chart_schema.py"


def _undescribed(values: dict[str, Any], schema: dict[str, Any], at: str) -> list[str]:
    """Keys of values.yaml that the schema does not name, at every level it describes."""
    if schema.get("$ref") or "properties" not in schema:
        return []
    missing = []
    for key, value in values.items():
        if key not in schema["properties"]:
            missing.append(f"{at}{key}")
        elif isinstance(value, dict):
            missing += _undescribed(value, schema["properties"][key], f"{at}{key}.")
    return missing


def test_schema_describes_every_value_and_refuses_unknown_keys() -> None:
    schema = json.loads(SCHEMA.read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert not _undescribed(yaml.safe_load(VALUES.read_text()), schema, "")

    def closed(node: dict[str, Any], at: str) -> list[str]:  # objects with fixed keys
        if "properties" not in node or not node["properties"]:
            return []
        found = [] if node.get("additionalProperties") is False else [at or "(root)"]
        for key, child in node["properties"].items():
            found += closed(child, f"{at}{key}.")
        return found

    assert not closed(schema, ""), "objects that accept unknown keys"


REFUSED = [
    ("--set=imag.tag=x", "additional properties 'imag' not allowed"),
    ("--set=replicaCount=two", "/replicaCount': got string, want integer"),
    ("--set=podDisruptionBudget.create=yes", "/podDisruptionBudget/create': got string"),
    ("--set=extraVolumeMounts[0].name=key", "missing property 'mountPath'"),
    ("--set=config.decode.polcy=x", "additional properties 'polcy' not allowed"),
    ("--set=config.timeouts.drain_s=long", "/config/timeouts/drain_s': got string, want number"),
]


@pytest.mark.parametrize(("value", "message"), REFUSED)
@pytest.mark.parametrize("command", ["lint", "template"])
def test_helm_refuses_a_typo_or_a_wrong_type(
    kube_bin: Path, command: str, value: str, message: str
) -> None:
    args = ["lint", "--strict"] if command == "lint" else ["template", "llm"]
    result = helm(kube_bin, *args, str(CHART), value)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr, result.stdout + result.stderr


# The defaults in each mode (an epp release names its gateway's pods), then each values file
# as its comment says to install it: the gateway-api-inference release with one gateway's file.
GATEWAY_RELEASE = "examples/gateway-api-inference/values.yaml"
ACCEPTED = [
    ["--set=mode=gateway"],
    ["--set=mode=epp", *(f"--set={key}={value}" for key, value in EPP_PEERS.items())],
] + [
    (
        ["-f", str(ROOT / GATEWAY_RELEASE)]
        if name.startswith(GATEWAY_RELEASE.rpartition("/")[0])
        else []
    )
    + ["-f", str(ROOT / name)]
    for name in chart_values_files()
    if name != GATEWAY_RELEASE
]


@pytest.mark.parametrize("values", ACCEPTED, ids=lambda args: args[-1].rpartition("examples/")[2])
def test_defaults_and_example_values_are_accepted_and_render_valid_objects(
    kube_bin: Path, values: list[str]
) -> None:
    lint = helm(kube_bin, "lint", "--strict", str(CHART), *values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    result = helm(kube_bin, "template", "llm", str(CHART), "-n", "llm", *values)
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "ConfigMap", "Service", "PodDisruptionBudget"} <= kinds
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _value_paths(values: dict[str, Any], schema: dict[str, Any], at: str) -> list[str]:
    """Every value a user sets: the leaves, and the maps or lists the schema leaves open."""
    paths = []
    for key, value in values.items():
        child = schema["properties"][key]
        if isinstance(value, dict) and value and "properties" in child and "$ref" not in child:
            paths += _value_paths(value, child, f"{at}{key}.")
        else:
            paths.append(f"{at}{key}")
    return paths


def test_chart_readme_documents_every_value_and_the_image_build() -> None:
    readme = (CHART / "README.md").read_text()
    schema = json.loads(SCHEMA.read_text())
    rows = set(re.findall(r"^\| `([^`]+)` \|", readme, re.MULTILINE))
    paths = set(_value_paths(yaml.safe_load(VALUES.read_text()), schema, ""))
    assert paths <= rows, f"values missing from the README's table: {sorted(paths - rows)}"
    assert rows - paths <= {"gateway", "epp"}, sorted(rows - paths - {"gateway", "epp"})
    assert f"docker build -t {PRODUCT_IMAGE} ." in readme
