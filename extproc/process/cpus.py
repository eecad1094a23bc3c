"""The CPUs this process may use: its affinity, capped by the cgroup v2 CPU quota (a pod's
CPU limit), rounded up. One ext_proc process uses at most one of them (`extproc.workers`), and
Envoy's worker threads (`envoy.concurrency`) want theirs: "auto" leaves them those.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = [
    "CGROUP_CPU_MAX",
    "MAX_WORKERS",
    "available_cpus",
    "cgroup_cpu_quota",
    "worker_count",
    "workers_above_cpus",
]

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cgroup_cpu_quota(path: Path = CGROUP_CPU_MAX) -> float | None:
    """The quota in CPUs ("200000 100000" → 2.0); None when unlimited ("max ..."), or when
    the file is missing or unreadable (cgroup v1, no cgroup namespace)."""
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus(path: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on, at most the cgroup quota rounded up (at least 1)."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(path)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


MAX_WORKERS = 64  # as the config's bound: each process probes and scrapes every engine too


def worker_count(setting: int | str, cpus: int, envoy_threads: int) -> int:
    """`extproc.workers` as a number of processes: "auto" is the CPUs left beside Envoy's
    worker threads, at least 1 (on 2 CPUs with one Envoy thread: 1), at most MAX_WORKERS."""
    if setting != "auto":
        return int(setting)
    return min(max(1, cpus - envoy_threads), MAX_WORKERS)


def workers_above_cpus(workers: int, cpus: int) -> str | None:
    """The warning for more ext_proc processes than CPUs (they would take turns on them, each
    request waiting for its process's turn), or None."""
    if workers <= cpus:
        return None
    return (
        f"extproc.workers is {workers} but this process may use {cpus} CPU(s) (its affinity and "
        f"cgroup CPU limit): the processes share them and each request waits its turn; set "
        f"extproc.workers: {cpus} or give the pod more CPU"
    )
