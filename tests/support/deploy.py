"""Shared checks for the deploy and example files: Envoy's own validator, YAML documents."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from extproc.process.envoy_process import envoy_binary

ROOT = Path(__file__).resolve().parents[2]


def envoy_validate(path: Path) -> None:
    """`envoy --mode validate`: parses every typed_config, so a wrong field name fails here."""
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "OK" in output, f"{path}:\n{output[-3000:]}"


def envoy_validate_dict(bootstrap: dict[str, Any], tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    envoy_validate(path)


def documents(path: Path) -> list[dict[str, Any]]:
    """The non-empty documents of a multi-document YAML file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc.get("kind") == kind]


K8S_VERSION = "1.30.0"


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = by_kind(docs, kind)
    return doc
