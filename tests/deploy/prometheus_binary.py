"""A real Prometheus (Debian's `prometheus` package) on a free loopback port, for the tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.process.subprocesses import terminate

INSTALL_HINT = "apt-get install -y --no-install-recommends prometheus (.ci/run does)"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI") == "true":  # CI installs it: a missing binary is a failure there
            pytest.fail(f"no prometheus binary ({INSTALL_HINT})")
        pytest.skip(f"no prometheus binary ({INSTALL_HINT})")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def running_prometheus(
    config: dict[str, Any], workdir: Path, ready_within_s: float = 30
) -> AsyncIterator[str]:
    """Prometheus scraping as `config` says; yields its base URL once /-/ready answers 200."""
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{_free_port()}"
    log = (workdir / "prometheus.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        prometheus_binary(),
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address={url[7:]}",
        stdout=log,
        stderr=log,
    )
    try:
        await _wait_ready(url, process, ready_within_s, workdir / "prometheus.log")
        yield url
    finally:
        await terminate(process, 10)
        log.close()


async def _wait_ready(
    url: str, process: asyncio.subprocess.Process, within_s: float, log: Path
) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while asyncio.get_running_loop().time() < deadline:
            if process.returncode is not None:
                raise RuntimeError(f"prometheus exited: {await _tail(log)}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + "/-/ready") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"prometheus not ready within {within_s:g} s: {await _tail(log)}")


async def _tail(log: Path) -> str:
    return (await asyncio.to_thread(log.read_text))[-2000:]
