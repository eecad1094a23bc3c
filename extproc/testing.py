"""Start a real `pd-extproc up` process for tests and benchmarks.

`async with running_sidecar(config_dict) as sidecar:` writes the config, starts Envoy + the
ext_proc as a subprocess on ephemeral ports, waits for its ready file (bounded) and stops it
on exit (SIGTERM, then SIGKILL of its whole process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from extproc.process.subprocesses import terminate

__all__ = ["SidecarHandle", "running_sidecar", "scrape"]


@dataclass(frozen=True)
class SidecarHandle:
    url: str
    envoy_admin: str
    metrics: str
    extproc: str
    pid: int
    log_path: Path
    config_path: Path
    process: asyncio.subprocess.Process
    worker_metrics: list[str]  # /metrics base URLs of extra ext_proc workers (extproc.workers)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait_exit(self, timeout_s: float) -> int:
        """The process's exit code, once it has exited by itself (bounded wait)."""
        return await asyncio.wait_for(self.process.wait(), timeout_s)


_POOLS = ("prefill", "decode")


def _round_robin_pools(section: dict[str, Any]) -> dict[str, Any]:
    out = dict(section)
    for role in _POOLS:
        if isinstance(out.get(role), dict):
            out[role] = {"policy": "round_robin", **out[role]}
    return out


def fixed_routing(config: dict[str, Any], pools: bool = True) -> dict[str, Any]:
    """`config` with round robin on every pool and the decision off, where it names neither
    (`pools` False: the decision alone, the pools left on the default policy).

    The defaults route by the KV cache and let D serve a prompt alone when that is faster: a
    test of a leg, a failure or a metric wants to know which engine comes next and that both
    legs run, so it states the predictable routing, and a test of routing states its own.
    """
    out = _round_robin_pools(config) if pools else dict(config)
    if pools and isinstance(out.get("models"), dict):
        out["models"] = {
            name: _round_robin_pools(group) if isinstance(group, dict) else group
            for name, group in out["models"].items()
        }
    decision = out.get("decision", {})
    if isinstance(decision, dict):
        out["decision"] = {"mode": "off", **decision}
    return out


def ephemeral_config(prefill: list[Any], decode: list[Any], **extra: Any) -> dict[str, Any]:
    """A config with every port left to the OS, round robin and no decision (`fixed_routing`);
    `extra` merges top-level sections."""
    config: dict[str, Any] = {
        "prefill": {"endpoints": prefill},
        "decode": {"endpoints": decode},
        # one process whatever the machine (not `auto`): a test that wants more says so
        "extproc": {"port": 0, "workers": 1},
        "metrics": {"port": 0, "ready_detail": True},  # tests read /ready?verbose
        "envoy": {"listen": {"port": 0}},
        "health": {"interval_s": 0.5, "timeout_s": 0.5},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return fixed_routing(config)


async def _wait_ready(
    path: Path, process: asyncio.subprocess.Process, timeout_s: float
) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"pd-extproc exited with {process.returncode}")
        if await asyncio.to_thread(path.exists):
            ready: dict[str, Any] = orjson.loads(await asyncio.to_thread(path.read_bytes))
            return ready
        await asyncio.sleep(0.05)
    raise TimeoutError(f"pd-extproc was not ready within {timeout_s:g} s")


@contextlib.asynccontextmanager
async def running_sidecar(
    config: dict[str, Any],
    start_timeout_s: float = 60.0,
    log_level: str = "INFO",
    env: Mapping[str, str] | None = None,  # over this process's environment
) -> AsyncIterator[SidecarHandle]:
    with tempfile.TemporaryDirectory(prefix="pd-extproc-test-") as tmp:
        config_path, ready = Path(tmp) / "config.yaml", Path(tmp) / "ready.json"
        log_path = Path(tmp) / "sidecar.log"
        config_path.write_text(yaml.safe_dump(config))
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "extproc",
                "--log-level",
                log_level,
                "up",
                "--config",
                str(config_path),
                "--ready-file",
                str(ready),
                stdout=log,
                stderr=log,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        try:
            try:
                info = await _wait_ready(ready, process, start_timeout_s)
            except (RuntimeError, TimeoutError) as error:
                raise RuntimeError(f"{error}:\n{log_path.read_text()[-3000:]}") from None
            yield SidecarHandle(
                info["url"],
                info["envoy_admin"],
                info["metrics"],
                info["extproc"],
                process.pid,
                log_path,
                config_path,
                process,
                info.get("worker_metrics", []),
            )
        finally:
            await terminate(process, 15)


async def scrape(
    session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0
) -> dict[str, float]:
    """Prometheus text → {'name{labels}': value} (enough for tests to compare counters)."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
