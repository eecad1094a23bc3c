"""Envoy and `pd-extproc serve` as two processes next to a P and a D engine, each one stopped,
restarted or signalled on its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from extproc.bootstrap.render import render_bootstrap, render_yaml
from extproc.config import parse_config
from extproc.process.envoy_process import EnvoyProcess
from extproc.testing import fixed_routing
from vllmsim.launcher import PUSH_D, PUSH_P, running_engine


class Split:
    def __init__(self, tmp: Path, config: dict) -> None:
        config = fixed_routing(config)
        self.tmp = tmp
        self.config_path = tmp / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.cfg = parse_config(config)
        self.extproc: asyncio.subprocess.Process | None = None
        self.envoy: EnvoyProcess | None = None
        self.url = ""
        self.metrics = ""  # the ext_proc's /metrics and /ready base URL

    async def start_extproc(self) -> None:
        ready = self.tmp / "ready.json"
        ready.unlink(missing_ok=True)
        log = (self.tmp / "extproc.log").open("ab")
        self.extproc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "extproc",
            "serve",
            "--config",
            str(self.config_path),
            "--prefill-listener",
            f"unix:{self.tmp / 'prefill.sock'}",
            "--ready-file",
            str(ready),
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        for _ in range(200):
            if ready.exists():
                self.metrics = orjson.loads(ready.read_bytes())["metrics"]
                return
            await asyncio.sleep(0.05)
        raise TimeoutError((self.tmp / "extproc.log").read_text())

    def kill_extproc(self) -> None:
        assert self.extproc is not None
        os.killpg(self.extproc.pid, signal.SIGKILL)

    async def start_envoy(self, buffered: bool = False) -> None:
        side = self.cfg.extproc.eds_access_log
        bootstrap = render_bootstrap(
            self.cfg,
            self.cfg.extproc.address,
            f"unix:{self.tmp / 'prefill.sock'}",
            None if side is None else side.address,
        )
        if buffered:
            bootstrap = as_buffered(bootstrap)
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

    def log_text(self) -> str:
        return (self.tmp / "extproc.log").read_text(errors="replace")

    async def ready_state(self) -> dict:
        return (await self.ready())[1]

    async def ready(self) -> tuple[int, dict]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                self.metrics + "/ready?verbose", timeout=aiohttp.ClientTimeout(total=5)
            ) as got,
        ):
            return got.status, orjson.loads(await got.read())


def as_buffered(bootstrap: dict) -> dict:
    """The bootstrap as rendered before the LLM routes streamed their body (what an older
    snippet in a user's Envoy still has): the filter's buffered mode on every route."""
    for listener in bootstrap["static_resources"]["listeners"]:
        for network_filter in listener["filter_chains"][0]["filters"]:
            routes = network_filter["typed_config"].get("route_config", {})
            for host in routes.get("virtual_hosts", []):
                for route in host["routes"]:
                    per_filter = route.get("typed_per_filter_config", {})
                    if "overrides" in per_filter.get("envoy.filters.http.ext_proc", {}):
                        del route["typed_per_filter_config"]
    return bootstrap


@contextlib.asynccontextmanager
async def split_topology(
    decode_dns: str | None = None,
    buffered: bool = False,
    engine_flags: Callable[[], Sequence[str]] = tuple,
    pool: dict | None = None,
    **overrides: Any,
) -> AsyncIterator[Split]:
    """`engine_flags`: more flags, made for each engine; `pool`: more keys of both pools."""
    async with (
        running_engine("--kv-transfer-config", PUSH_P, *engine_flags()) as p,
        running_engine(
            "--kv-transfer-config", PUSH_D, "--step-base-ms", "20", *engine_flags()
        ) as d,
    ):
        with tempfile.TemporaryDirectory(prefix="pd-split-") as tmp:
            split = Split(
                Path(tmp),
                {
                    "prefill": {"endpoints": [f"127.0.0.1:{p.port}"], **(pool or {})},
                    "decode": {
                        "endpoints": [f"127.0.0.1:{d.port}"],
                        "dns": decode_dns,
                        **(pool or {}),
                    },
                    "extproc": {"host": f"unix:{tmp}/extproc.sock"},
                    "metrics": {"port": 0, "ready_detail": True},
                    "envoy": {"listen": {"port": 0}},
                    **overrides,
                },
            )
            try:
                await split.start_extproc()
                await split.start_envoy(buffered)
                yield split
            finally:
                await split.stop()
