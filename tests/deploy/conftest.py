"""helm and kubectl for the chart and kustomize checks: static binaries from the project's cache
(scripts/cached_envs.py kube-tools), fetched on first use, then reused by every run."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.cached_envs import kube_tools


@pytest.fixture(scope="session")
def kube_bin() -> Path:
    return kube_tools()
