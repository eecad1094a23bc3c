"""The start-up hooks of the real-vLLM engines (scripts/engine_site/sitecustomize.py): AMX
permission is asked for exactly when the CPU has AMX, and the hook never stops an engine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import scripts.real_vllm
from scripts.engine_site.sitecustomize import AMX_FLAG, cpu_flags, request_amx_permission
from scripts.real_vllm import ENGINE_SITE, hooks_dir

# Flags of the CPU this suite was first run on (AMD EPYC, no AMX), and those of a Sapphire Rapids.
NO_AMX = {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}
WITH_AMX = NO_AMX | {"amx_bf16", "amx_tile", "amx_int8"}


class RecordingSyscall:
    def __init__(self, result: int | Exception = 0) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.result = result

    def __call__(self, number: int, first: int, second: int) -> int:
        self.calls.append((number, first, second))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_no_syscall_without_amx() -> None:
    syscall = RecordingSyscall()
    assert request_amx_permission(NO_AMX, syscall) is False
    assert syscall.calls == []


def test_amx_cpu_asks_for_tile_data_once() -> None:
    syscall = RecordingSyscall()
    assert request_amx_permission(WITH_AMX, syscall) is True
    assert syscall.calls == [(158, 0x1023, 18)]


@pytest.mark.parametrize("result", [-1, OSError("libc without syscall")])
def test_failing_syscall_is_ignored(result: int | Exception) -> None:
    syscall = RecordingSyscall(result)
    assert request_amx_permission(WITH_AMX, syscall) is False
    assert len(syscall.calls) == 1


def test_cpu_flags_reads_the_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\n"
        "flags\t\t: fpu sse2 amx_tile avx2\nbugs\t\t: spectre_v1\n"
    )
    assert cpu_flags(cpuinfo) == {"fpu", "sse2", "amx_tile", "avx2"}
    assert cpu_flags(tmp_path / "absent") == frozenset()


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(),
    reason="arch_prctl is x86_64 Linux",
)
def test_real_syscall_matches_this_cpu() -> None:
    """Forced through the real arch_prctl: granted on a CPU with AMX; on one without it the
    kernel refuses and the hook returns False without raising."""
    has_amx = AMX_FLAG in cpu_flags()
    assert request_amx_permission({AMX_FLAG}) is has_amx
    assert request_amx_permission() is has_amx  # the engines' call: reads this CPU's flags


def test_engine_interpreter_loads_the_hooks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interpreter started like an engine (PYTHONPATH = hooks_dir()) runs the hooks at start,
    harmlessly on this CPU, and reports the AMX permission only where it was granted."""
    monkeypatch.setattr(scripts.real_vllm, "CACHE_DIR", tmp_path)
    site = hooks_dir()
    assert (site / "sitecustomize.py").read_text() == ENGINE_SITE.read_text()
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "PD_RV_AFFINITY_GUARD": "1",
        "PD_RV_NIXL_DELAY_US": "100",
    }
    probe = (
        "import os, sys; print(sys.modules['sitecustomize'].__file__); "
        "os.sched_setaffinity(0, {max(os.sched_getaffinity(0)) + 64}); print('alive')"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(site / "sitecustomize.py"), "alive"]
    granted = "[engine_site] AMX tile data permission granted" in done.stderr
    assert granted is (AMX_FLAG in cpu_flags() and platform.machine() == "x86_64"), done.stderr
