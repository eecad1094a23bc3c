"""Start real `vllmsim` processes (tests, scripts, benchmarks, `pd-extproc demo`): ``async with
running_engine(*flags) as eng``.

Each engine gets ``--port 0 --port-file`` and, unless `env` says otherwise, an
ephemeral side-channel port on 127.0.0.1. The helper waits for the port file (with a
timeout), and on exit sends SIGTERM, then SIGKILL if the process lingers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PUSH_P = '{"kv_connector":"NixlPushConnector","kv_role":"kv_producer"}'
PUSH_D = '{"kv_connector":"NixlPushConnector","kv_role":"kv_consumer"}'
PULL_P = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
PULL_D = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
# Timing-insensitive tests: fast steps and transfers keep the suite short.
FAST = (
    "--step-base-ms",
    "1",
    "--prefill-per-token-ms",
    "0.001",
    "--decode-per-seq-ms",
    "0",
    "--api-overhead-ms",
    "0",
    "--api-intake-ms",
    "0",
    "--stream-per-token-ms",
    "0",
)


@dataclass(frozen=True)
class EngineHandle:
    url: str
    port: int
    side_channel_port: int
    engine_id: str
    pid: int
    log_path: Path
    kv_events_endpoint: str | None = None  # with --kv-events-config: where the PUB socket is
    kv_events_replay_endpoint: str | None = None
    # per data-parallel rank: {rank, engine_id, side_channel_port, ...} at start-up
    ranks: tuple[dict[str, Any], ...] = ()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def vllmsim_command() -> list[str]:
    """The installed console script next to this interpreter, else `python -m vllmsim`."""
    script = Path(sys.executable).parent / "vllmsim"
    if script.exists():
        return [str(script)]
    found = shutil.which("vllmsim")
    return [found] if found else [sys.executable, "-m", "vllmsim"]


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "0"
    env.update(extra or {})
    return env


def _read_port_file(path: Path) -> dict[str, Any] | None:
    try:
        ports: dict[str, Any] = json.loads(path.read_text())
        return ports
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _handle(info: dict[str, Any], log_path: Path) -> EngineHandle:
    return EngineHandle(
        f"http://127.0.0.1:{info['port']}",
        int(info["port"]),
        int(info["side_channel_port"]),
        str(info["engine_id"]),
        int(info["pid"]),
        log_path,
        info.get("kv_events_endpoint"),
        info.get("kv_events_replay_endpoint"),
        tuple(info.get("ranks", ())),
    )


@contextlib.asynccontextmanager
async def running_engine(
    *flags: str, env: Mapping[str, str] | None = None, start_timeout: float = 10.0
) -> AsyncIterator[EngineHandle]:
    with tempfile.TemporaryDirectory(prefix="vllmsim-") as tmp:
        port_file, log_path = Path(tmp) / "port.json", Path(tmp) / "engine.log"
        with log_path.open("wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *vllmsim_command(),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                *flags,
                env=_env(env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + start_timeout
            while (info := _read_port_file(port_file)) is None:
                if proc.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllmsim did not start: {log_path.read_text()}")
                await asyncio.sleep(0.02)
            yield _handle(info, log_path)
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 5.0)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


@contextlib.contextmanager
def running_engine_sync(
    *flags: str, env: Mapping[str, str] | None = None, start_timeout: float = 10.0
) -> Iterator[EngineHandle]:
    """The same as `running_engine`, for code outside asyncio."""
    with tempfile.TemporaryDirectory(prefix="vllmsim-") as tmp:
        port_file, log_path = Path(tmp) / "port.json", Path(tmp) / "engine.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    *vllmsim_command(),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--port-file",
                    str(port_file),
                    *flags,
                ],
                env=_env(env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + start_timeout
            while (info := _read_port_file(port_file)) is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllmsim did not start: {log_path.read_text()}")
                time.sleep(0.02)
            yield _handle(info, log_path)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
