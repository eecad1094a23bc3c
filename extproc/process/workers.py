"""Extra ext_proc processes for `extproc.workers` > 1: one Python process is one core.

Each worker is a `pd-extproc serve` child with the same configuration but its own free port
(or socket) and metrics port; Envoy spreads streams over all of them (LEAST_REQUEST). Each
keeps its own identity cache, health view and in-flight counts: they learn the same facts
from the same engines, and least-request picking works per process. The limits on what the
sidecar holds are shared out (`limits_share`): each process admits its part of every
`admission.*.max_in_flight` and holds its part of the body budget, so that together they keep
the operator's numbers. Each also serves the pools' members over EDS (Envoy's stream may reach
any of them), so a reload reaches every worker; their metrics join the main process's page
(`extproc.process.worker_pages`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import signal
import sys
from pathlib import Path
from typing import Any

import orjson
import yaml

from extproc.config import AdmissionLimits, Config, LoadTableConfig
from extproc.process.subprocesses import terminate

__all__ = ["WorkerProcesses", "kv_relay", "limits_share", "load_table", "share_load"]


def limits_share(config: Config, processes: int) -> Config:
    """`config` for one of `processes` ext_procs of one sidecar: its part of each role's
    `max_in_flight` (rounded up) and of the body budget (at least one body of max_body_bytes)."""
    if processes <= 1:
        return config

    def share(limits: AdmissionLimits) -> AdmissionLimits:
        most = limits.max_in_flight
        part = None if most is None else math.ceil(most / processes)
        return limits.model_copy(update={"max_in_flight": part})

    admission, limits = config.admission, config.limits
    budget = max(limits.max_body_bytes, limits.body_budget_bytes // processes)
    return config.model_copy(
        update={
            "admission": admission.model_copy(
                update={"prefill": share(admission.prefill), "decode": share(admission.decode)}
            ),
            "limits": limits.model_copy(update={"max_body_bytes_in_flight": budget}),
        }
    )


def load_table(run_dir: Path) -> Path:
    """Where the ext_procs share their load counts (`extproc.scheduling.shared_load`)."""
    return run_dir / "load.table"


def share_load(config: Config, processes: int, row: int, run_dir: Path) -> Config:
    """`config` for the ext_proc of `row` among `processes` that count each other's load
    (`extproc.share_load`); unchanged for one process or with sharing off."""
    if processes <= 1 or not config.extproc.share_load:
        return config
    table = LoadTableConfig(path=str(load_table(run_dir)), rows=processes, row=row)
    return config.model_copy(
        update={"extproc": config.extproc.model_copy(update={"load_table": table})}
    )


def kv_relay(run_dir: Path) -> str:
    """Where the main ext_proc passes on the KV events engines send it, for the others."""
    return f"ipc://{run_dir / 'kv-events.relay'}"


def _worker_config(
    config: Config, index: int, private: Path | None, processes: int, run_dir: Path
) -> dict[str, Any]:
    """`private`: the run directory whose Unix sockets `up`'s ext_procs listen on;
    `processes`: how many share the limits, this one too."""
    shared = share_load(limits_share(config, processes), processes, index, run_dir)
    data = shared.model_dump(mode="json", exclude_none=True)
    extproc = data["extproc"]
    if extproc["host"].startswith("unix:"):
        extproc["host"] = f"{extproc['host']}.{index}"
    elif private is not None:
        extproc["host"] = f"unix:{private / f'extproc.sock.{index}'}"
    else:
        extproc["port"] = 0
    extproc["workers"] = 1
    # the main process binds the KV events' port and relays what it hears (`kv_relay`)
    data["kv_listener"] |= {"listen": False, "relay": kv_relay(run_dir)}
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
        self._sharing = 1  # the ext_procs the limits are shared among, the main one too

    async def start(self, count: int, timeout_s: float = 30.0) -> None:
        """Start `count` workers and wait (bounded) until each listens."""
        self._sharing = count + 1
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
        data = _worker_config(self.config, index, self._private, self._sharing, self.run_dir)
        config_path.write_text(yaml.safe_dump(data))
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
            text = yaml.safe_dump(
                _worker_config(config, index, self._private, self._sharing, self.run_dir)
            )
            await asyncio.to_thread(self._config_path(index).write_text, text)
            if process.returncode is None:
                process.send_signal(signal.SIGHUP)

    async def stop(self, grace_s: float) -> None:
        await asyncio.gather(*(terminate(p, grace_s + 5) for p in self.processes))
