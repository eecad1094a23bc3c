"""The CPUs an ext_proc may use: affinity capped by the cgroup v2 quota (a pod's CPU limit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from extproc.process.cpus import (
    available_cpus,
    cgroup_cpu_quota,
    worker_count,
    workers_above_cpus,
)


def _cpu_max(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cpu.max"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "quota"),
    [
        ("200000 100000\n", 2.0),  # limits.cpu: 2
        ("150000 100000\n", 1.5),  # limits.cpu: 1500m
        ("50000 100000\n", 0.5),
        ("max 100000\n", None),  # no limit
        ("", None),
        ("garbage\n", None),
        ("abc 100000\n", None),
        ("0 100000\n", None),
    ],
)
def test_quota_read_from_cpu_max(tmp_path: Path, text: str, quota: float | None) -> None:
    assert cgroup_cpu_quota(_cpu_max(tmp_path, text)) == quota


def test_no_cgroup_file_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path / "missing") is None


def test_quota_caps_the_affinity_rounded_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert available_cpus(_cpu_max(tmp_path, "150000 100000")) == 2
    assert available_cpus(_cpu_max(tmp_path, "50000 100000")) == 1
    assert available_cpus(_cpu_max(tmp_path, "max 100000")) == 8
    assert available_cpus(_cpu_max(tmp_path, "1600000 100000")) == 8  # the affinity is lower
    assert available_cpus(tmp_path / "missing") == 8


def test_affinity_counts_without_a_quota(tmp_path: Path) -> None:
    assert available_cpus(tmp_path / "missing") == len(os.sched_getaffinity(0))


def test_more_workers_than_cpus_is_worded() -> None:
    assert workers_above_cpus(2, 2) is None
    assert workers_above_cpus(1, 1) is None
    warning = workers_above_cpus(4, 2)
    assert warning is not None
    assert "extproc.workers is 4" in warning and "extproc.workers: 2" in warning


def test_auto_workers_leave_envoys_threads_their_cpus() -> None:
    assert worker_count("auto", cpus=2, envoy_threads=1) == 1  # this repository's CI machine
    assert worker_count("auto", cpus=8, envoy_threads=2) == 6
    assert worker_count("auto", cpus=1, envoy_threads=1) == 1  # never none
    assert worker_count("auto", cpus=256, envoy_threads=4) == 64  # nor more than the config allows
    assert worker_count(3, cpus=1, envoy_threads=1) == 3  # a number is taken as it is
