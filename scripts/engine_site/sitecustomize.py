"""Start-up hooks for every real vLLM engine the harness starts.

scripts/real_vllm.py copies this file into a directory of its own and puts that directory on the
engine's PYTHONPATH, so Python runs it (as `sitecustomize`) when each engine interpreter starts,
before vLLM is imported. Imported under any other name (the unit tests) it only defines things.

1. AMX permission. vLLM 0.32's CPU attention picks its AMX kernel from CPUID alone and never asks
   Linux for permission to use the AMX tile registers; Linux grants that per process and drops it
   across exec. Without it the first AMX instruction raises SIGILL: on a CPU with AMX the decode
   engine's worker died on its first decode step. Every engine asks at start; a no-op elsewhere.
2. Affinity guard. vLLM's NIXL worker on the CPU platform pins itself to the last core of the
   NUMA node; with two engines on two cores both workers end up on one core and push mode stalls
   for seconds. Keep any affinity change inside the CPU set the engine was started with.
3. NIXL progress thread. nixl's Python wrapper sets the progress thread's delay to 0, so an idle
   agent spins a core. Force a small delay (PD_RV_NIXL_DELAY_US) whenever it is set.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import os
import platform
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

# Linux x86_64 ABI: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) asks for AMX tile data.
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
AMX_FLAG = "amx_tile"

Syscall = Callable[[int, int, int], int]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty when it reports none)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def libc_syscall(number: int, first: int, second: int) -> int:
    """syscall(2) through libc: 0 on success, -1 on failure."""
    return int(ctypes.CDLL(None, use_errno=True).syscall(number, first, second))


def request_amx_permission(
    flags: Iterable[str] | None = None, syscall: Syscall | None = None
) -> bool:
    """Ask Linux for AMX tile data when the CPU has AMX; True only if it was granted.

    Never raises: an engine that cannot get the permission still starts (and then fails where it
    always did, with vLLM's own error)."""
    if AMX_FLAG not in (cpu_flags() if flags is None else frozenset(flags)):
        return False
    try:
        return (syscall or libc_syscall)(
            SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
        ) == 0
    except Exception:  # a start-up hook must not stop the engine
        return False


def guard_affinity() -> None:
    """Clamp every later sched_setaffinity to the CPU set this process started with."""
    start_cpus = frozenset(os.sched_getaffinity(0))
    set_affinity = os.sched_setaffinity

    def guarded(pid: int, cpus: Iterable[int]) -> None:
        allowed = frozenset(cpus) & start_cpus
        if allowed:
            set_affinity(pid, allowed)

    os.sched_setaffinity = guarded


def _slow_progress_thread(module: ModuleType, delay_us: int) -> None:
    base = module.nixlBind.nixlAgentConfig
    if getattr(base, "_pd_rv_delay", False):
        return

    class DelayedConfig(base):
        _pd_rv_delay = True

        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    module.nixlBind.nixlAgentConfig = DelayedConfig


class NixlDelayHook(importlib.abc.MetaPathFinder):
    """Patches nixl's agent config class right after nixl's `_api` module is loaded."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ("nixl_cu12._api", "nixl_cu13._api"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        delay_us = self.delay_us

        def exec_module(module: ModuleType) -> None:
            run(module)
            _slow_progress_thread(module, delay_us)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if platform.machine() == "x86_64" and request_amx_permission():
        print("[engine_site] AMX tile data permission granted", file=sys.stderr, flush=True)
    if os.environ.get("PD_RV_AFFINITY_GUARD") == "1" and hasattr(os, "sched_setaffinity"):
        guard_affinity()
    if delay := os.environ.get("PD_RV_NIXL_DELAY_US"):
        sys.meta_path.insert(0, NixlDelayHook(int(delay)))


if __name__ == "sitecustomize":
    install()
