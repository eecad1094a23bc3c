"""Extra ext_proc processes for `extproc.workers` > 1: one Python process is one core.

Each worker is a `pd-extproc serve` child with the same configuration but its own free port
(or socket) and metrics port; Envoy spreads streams over all of them (LEAST_REQUEST). Each
keeps its own identity cache, health view and in-flight counts: they learn the same facts
from the same engines, and least-request picking works per process. Each also serves the pools'
members over EDS (Envoy's stream may reach any of them), so a reload reaches every worker.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys
from pathlib import Path
from typing import Any

import orjson
import yaml

from extproc.config import Config
from extproc.process.subprocesses import terminate

__all__ = ["WorkerProcesses"]


def _worker_config(config: Config, index: int, private: Path | None) -> dict[str, Any]:
    """`private`: the run directory whose Unix sockets `up`'s ext_procs listen on."""
    data = config.model_dump(mode="json", exclude_none=True)
    extproc = data["extproc"]
    if extproc["host"].startswith("unix:"):
        extproc["host"] = f"{extproc['host']}.{index}"
    elif private is not None:
        extproc["host"] = f"unix:{private / f'extproc.sock.{index}'}"
    else:
        extproc["port"] = 0
    extproc["workers"] = 1
    if private is not None:  # `up`: EDS and the access log on each worker's socket too
        extproc.pop("eds_access_log", None)
    data["metrics"]["port"] = 0
    return data


async def _ready_info(path: Path) -> dict[str, Any]:
    """The worker's ready file, once it exists (the caller bounds the wait)."""
    for _ in itertools.count():
        if await asyncio.to_thread(path.exists):
            break
        await asyncio.sleep(0.05)
    ready: dict[str, Any] = orjson.loads(await asyncio.to_thread(path.read_bytes))
    return ready


class WorkerProcesses:
    def __init__(
        self, config: Config, run_dir: Path, prefill_listener: str, private: bool = False
    ) -> None:
        """`private`: listen on Unix sockets in `run_dir` (`up`), not on free ports."""
        self.config = config
        self.run_dir = run_dir
        self._private = run_dir if private else None
        self.prefill_listener = prefill_listener
        self.processes: list[asyncio.subprocess.Process] = []
        self.addresses: list[str] = []
        self.metrics: list[str] = []

    async def start(self, count: int, timeout_s: float = 30.0) -> None:
        """Start `count` workers and wait (bounded) until each listens."""
        ready_files = [await self._spawn(index) for index in range(1, count + 1)]
        async with asyncio.timeout(timeout_s):
            for ready in ready_files:
                info = await _ready_info(ready)
                self.addresses.append(info["extproc"])
                self.metrics.append(info["metrics"])

    def _config_path(self, index: int) -> Path:
        return self.run_dir / f"worker-{index}.yaml"

    async def _spawn(self, index: int) -> Path:
        config_path = self._config_path(index)
        ready = self.run_dir / f"worker-{index}.ready"
        config_path.write_text(yaml.safe_dump(_worker_config(self.config, index, self._private)))
        with (self.run_dir / f"worker-{index}.log").open("wb") as log:
            self.processes.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "extproc",
                    "serve",
                    "--config",
                    str(config_path),
                    "--prefill-listener",
                    self.prefill_listener,
                    "--ready-file",
                    str(ready),
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            )
        return ready

    async def reload(self, config: Config) -> None:
        """Hand a reloaded config to every worker (its file rewritten, then SIGHUP)."""
        self.config = config
        for index, process in enumerate(self.processes, start=1):
            text = yaml.safe_dump(_worker_config(config, index, self._private))
            await asyncio.to_thread(self._config_path(index).write_text, text)
            if process.returncode is None:
                process.send_signal(signal.SIGHUP)

    async def stop(self, grace_s: float) -> None:
        await asyncio.gather(*(terminate(p, grace_s + 5) for p in self.processes))
