"""Envoy and the ext_proc as separate processes (`pd-extproc serve` next to an Envoy):
either can die and come back without the other being restarted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import yaml

from extproc.config import parse_config
from extproc.envoy_config import render_bootstrap, render_yaml
from extproc.envoy_process import EnvoyProcess
from tests.integration.conftest import MODEL
from vllmsim.testing import PUSH_D, PUSH_P, running_engine

COMPLETION = {"model": MODEL, "prompt": "split processes " * 10, "max_tokens": 4}


class Split:
    def __init__(self, tmp: Path, config: dict) -> None:
        self.tmp = tmp
        self.config_path = tmp / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.cfg = parse_config(config)
        self.extproc: asyncio.subprocess.Process | None = None
        self.envoy: EnvoyProcess | None = None
        self.url = ""

    async def start_extproc(self) -> None:
        ready = self.tmp / "ready.json"
        ready.unlink(missing_ok=True)
        log = (self.tmp / "extproc.log").open("ab")
        self.extproc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "serve", "--config", str(self.config_path),
            "--prefill-listener", f"unix:{self.tmp / 'prefill.sock'}",
            "--ready-file", str(ready), stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        for _ in range(200):
            if ready.exists():
                return
            await asyncio.sleep(0.05)
        raise TimeoutError((self.tmp / "extproc.log").read_text())

    def kill_extproc(self) -> None:
        assert self.extproc is not None
        os.killpg(self.extproc.pid, signal.SIGKILL)

    async def start_envoy(self) -> None:
        bootstrap = render_bootstrap(
            self.cfg, self.cfg.extproc.address, f"unix:{self.tmp / 'prefill.sock'}"
        )
        (self.tmp / "envoy.yaml").write_text(render_yaml(bootstrap))
        self.envoy = EnvoyProcess(self.tmp / "envoy.yaml", self.tmp, "warning", 1)
        await self.envoy.start()
        self.url = "http://" + await self.envoy.listener_address("ingress")

    async def stop(self) -> None:
        if self.envoy is not None:
            await self.envoy.stop()
        if self.extproc is not None and self.extproc.returncode is None:
            self.extproc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.extproc.wait(), 10)
            except TimeoutError:
                self.kill_extproc()


@contextlib.asynccontextmanager
async def split_topology() -> AsyncIterator[Split]:
    async with (
        running_engine("--kv-transfer-config", PUSH_P) as p,
        running_engine("--kv-transfer-config", PUSH_D) as d,
    ):
        with tempfile.TemporaryDirectory(prefix="pd-split-") as tmp:
            split = Split(Path(tmp), {
                "prefill": {"endpoints": [f"127.0.0.1:{p.port}"]},
                "decode": {"endpoints": [f"127.0.0.1:{d.port}"]},
                "extproc": {"host": f"unix:{tmp}/extproc.sock"},
                "metrics": {"port": 0},
                "envoy": {"listen": {"port": 0}},
            })  # fmt: skip
            try:
                await split.start_extproc()
                await split.start_envoy()
                yield split
            finally:
                await split.stop()


async def post(url: str) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/completions", json=COMPLETION, timeout=aiohttp.ClientTimeout(total=10)
        ) as response,
    ):
        return response.status, orjson.loads(await response.read())


async def eventually_ok(url: str, within_s: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < within_s:
        status, _ = await post(url)
        if status == 200:
            return time.perf_counter() - started
        await asyncio.sleep(0.1)
    raise AssertionError(f"no 200 within {within_s} s")


async def test_extproc_down_gives_clear_503_and_service_resumes_without_envoy_restart() -> None:
    async with split_topology() as split:
        assert (await post(split.url))[0] == 200
        split.kill_extproc()
        await split.extproc.wait()
        started = time.perf_counter()
        status, body = await post(split.url)
        assert time.perf_counter() - started < 1.0
        assert status == 503
        assert body["error"]["message"] == "the pd-extproc ext_proc is unavailable; retry"
        envoy_pid = split.envoy._process.pid
        await split.start_extproc()
        await eventually_ok(split.url, within_s=10)
        assert split.envoy._process.pid == envoy_pid


async def test_envoy_restart_is_served_by_the_running_extproc() -> None:
    async with split_topology() as split:
        assert (await post(split.url))[0] == 200
        extproc_pid = split.extproc.pid
        await split.envoy.stop()
        await split.start_envoy()
        await eventually_ok(split.url, within_s=10)
        assert split.extproc.returncode is None and split.extproc.pid == extproc_pid
