"""What the engines and the sidecar did during each cell of a process benchmark.

`EngineProbe` samples every engine's batch (`running`) and queue (`waiting`) from vllmsim's
GET /sim/state every `every_s` while a measured run is under way, and at the runs' boundaries
takes each engine's step lateness (how much later than its cost model its steps ended: the
process got the CPU late) and each pd-extproc target's per-request decisions
(`pd_extproc_dispatch_decisions_total`), as differences over the cell's runs. `summary()` gives,
per cell and engine, the mean, p50, p90 and max of the samples, the steps and their lateness;
per cell, the decisions by outcome and reason, the requests routed without their token ids
(`pd_extproc_kv_untokenized_requests_total`), each CPU's busy share over the cell's runs
(/proc/stat: user, system, irq and softirq time, not niced processes') and each engine
process's CPU time over the cell's wall time (/proc/PID/stat).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.engines import Engines
from extproc.testing import scrape

DECISIONS = "pd_extproc_dispatch_decisions_total"
UNTOKENIZED = "pd_extproc_kv_untokenized_requests_total"
PROC_STAT = Path("/proc/stat")


def cpu_times() -> dict[str, tuple[float, float]]:
    """Per CPU (cpu0, cpu1, ...): (busy, total) jiffies so far; busy leaves out niced time
    (other jobs run niced here) and idle. Empty where /proc/stat is not there."""
    if not PROC_STAT.is_file():
        return {}
    out = {}
    for line in PROC_STAT.read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            ticks = [float(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            busy = ticks[0] + ticks[2] + ticks[5] + ticks[6]
            out[name] = (busy, sum(ticks))
    return out


def _named(engines: Engines) -> dict[str, str]:
    """Engine name (P0, D1, ...) → its base URL."""
    return {name: handle.url for name, handle in _handles(engines).items()}


def _handles(engines: Engines) -> dict[str, Any]:
    return {
        f"{role}{index}": handle
        for role, handles in (("P", engines.prefill), ("D", engines.decode))
        for index, handle in enumerate(handles)
    }


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far (0 where /proc cannot tell)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _stats(samples: list[int]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)
    return {
        "mean": round(sum(ordered) / len(ordered), 2),
        "p50": ordered[len(ordered) // 2],
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
        "samples": len(ordered),
    }


def _share(engine: dict[str, float], wall: dict[str, float]) -> float | None:
    """The engine process's CPU seconds over the wall seconds of the cell's runs."""
    return round(engine.get("cpu_s", 0.0) / wall["s"], 3) if wall.get("s") else None


@dataclass
class EngineProbe:
    engines: Engines
    metrics: dict[str, str]  # pd-extproc config name → its sidecar's /metrics base URL
    every_s: float
    current: str | None = None  # the cell whose run is under way (None: a warm-up)
    _batches: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    _queues: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    _late: dict[str, dict[str, dict[str, float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    )
    _decisions: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    _untokenized: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _cpu: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    )
    _last: dict[str, Any] = field(default_factory=dict)

    async def _states(self, http: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
        out = {}
        for name, url in _named(self.engines).items():
            async with http.get(url + "/sim/state", timeout=aiohttp.ClientTimeout(5)) as resp:
                resp.raise_for_status()
                out[name] = await resp.json()
        return out

    async def _counters(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        late = {
            name: {
                "steps": s["step_lateness"]["steps"],
                "late_s": s["step_lateness"]["late_s"],
                "planned_s": s["step_lateness"]["planned_s"],
                **{
                    f"late>{le}ms": sum(
                        n for b, n in s["step_lateness"]["buckets_ms"].items() if float(b) > le
                    )
                    for le in (5.0, 20.0)
                },
            }
            for name, s in (await self._states(http)).items()
        }
        decisions, untokenized = {}, defaultdict(float)
        for config, base in self.metrics.items():
            for key, value in (await scrape(http, base + "/metrics")).items():
                if key.startswith(DECISIONS):
                    decisions[f"{config}{key.removeprefix(DECISIONS)}"] = value
                elif key.startswith(UNTOKENIZED):  # every reason
                    untokenized[config] += value
        for name, handle in _handles(self.engines).items():
            late[name]["cpu_s"] = process_cpu_s(handle.pid)
        late["wall"] = {"s": time.monotonic()}
        return {
            "late": late,
            "decisions": decisions,
            "untokenized": untokenized,
            "cpu": cpu_times(),
        }

    async def boundary(
        self, http: aiohttp.ClientSession, done: str | None, upcoming: str | None
    ) -> None:
        """Between two runs: charge the counters' differences to `done`'s cell, sample for
        `upcoming`'s from now on (each a cell id, None for a warm-up)."""
        now = await self._counters(http)
        if done is not None and self._last:
            for name, values in now["late"].items():
                for key, value in values.items():
                    self._late[done][name][key] += value - self._last["late"][name][key]
            for cpu, (busy, total) in now["cpu"].items():
                was = self._last["cpu"].get(cpu, (busy, total))
                self._cpu[done][cpu][0] += busy - was[0]
                self._cpu[done][cpu][1] += total - was[1]
            for key, value in now["decisions"].items():
                config, _, labels = key.partition("{")
                if done.split("|")[1] == config:
                    self._decisions[done][labels.rstrip("}")] += value - self._last[
                        "decisions"
                    ].get(key, 0.0)
            config = done.split("|")[1]
            self._untokenized[done] += now["untokenized"].get(config, 0.0) - self._last[
                "untokenized"
            ].get(config, 0.0)
        self._last, self.current = now, upcoming

    async def _sample(self, http: aiohttp.ClientSession) -> None:
        while True:
            cell = self.current
            if cell is not None:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    for name, state in (await self._states(http)).items():
                        self._batches[cell][name].append(state["running"])
                        self._queues[cell][name].append(state["waiting"])
            await asyncio.sleep(self.every_s)

    @contextlib.asynccontextmanager
    async def sampling(self, http: aiohttp.ClientSession) -> AsyncIterator[None]:
        task = asyncio.create_task(self._sample(http))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def summary(self) -> dict[str, Any]:
        """Per cell id: each engine's running and waiting samples' statistics and its step
        lateness; the decisions by outcome and reason; the requests without token ids."""
        cells = set(self._batches) | set(self._late)
        return {
            cell: {
                "engines": {
                    name: {
                        "running": _stats(self._batches[cell][name]),
                        "waiting": _stats(self._queues[cell][name]),
                        **{k: round(v, 4) for k, v in self._late[cell][name].items()},
                        "cpu_share": _share(self._late[cell][name], self._late[cell]["wall"]),
                    }
                    for name in _named(self.engines)
                },
                "decisions": dict(self._decisions.get(cell, {})),
                "untokenized": self._untokenized.get(cell, 0.0),
                "cpu_busy": {
                    cpu: round(busy / total, 3) if total else None
                    for cpu, (busy, total) in self._cpu.get(cell, {}).items()
                },
            }
            for cell in sorted(cells)
        }
