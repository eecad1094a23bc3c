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

from extproc.bootstrap.render import render_bootstrap, render_yaml
from extproc.config import parse_config
from extproc.process.envoy_process import EnvoyProcess
from tests.support.engines import MODEL
from vllmsim.launcher import PUSH_D, PUSH_P, running_engine

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
        self.metrics = ""  # the ext_proc's /metrics and /ready base URL

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
                self.metrics = orjson.loads(ready.read_bytes())["metrics"]
                return
            await asyncio.sleep(0.05)
        raise TimeoutError((self.tmp / "extproc.log").read_text())

    def kill_extproc(self) -> None:
        assert self.extproc is not None
        os.killpg(self.extproc.pid, signal.SIGKILL)

    async def start_envoy(self, buffered: bool = False) -> None:
        bootstrap = render_bootstrap(
            self.cfg, self.cfg.extproc.address, f"unix:{self.tmp / 'prefill.sock'}"
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
            session.get(self.metrics + "/ready", timeout=aiohttp.ClientTimeout(total=5)) as got,
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
    decode_dns: str | None = None, buffered: bool = False, **overrides: dict
) -> AsyncIterator[Split]:
    async with (
        running_engine("--kv-transfer-config", PUSH_P) as p,
        running_engine("--kv-transfer-config", PUSH_D, "--step-base-ms", "20") as d,
    ):
        with tempfile.TemporaryDirectory(prefix="pd-split-") as tmp:
            split = Split(Path(tmp), {
                "prefill": {"endpoints": [f"127.0.0.1:{p.port}"]},
                "decode": {"endpoints": [f"127.0.0.1:{d.port}"], "dns": decode_dns},
                "extproc": {"host": f"unix:{tmp}/extproc.sock"},
                "metrics": {"port": 0},
                "envoy": {"listen": {"port": 0}},
                **overrides,
            })  # fmt: skip
            try:
                await split.start_extproc()
                await split.start_envoy(buffered)
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


async def test_an_envoy_with_buffered_llm_routes_is_still_served() -> None:
    async with split_topology(buffered=True) as split:
        envoy_yaml = (split.tmp / "envoy.yaml").read_text()
        assert "FULL_DUPLEX_STREAMED" not in envoy_yaml and "BUFFERED" in envoy_yaml
        status, body = await post(split.url)
        assert status == 200, body
        assert body["choices"][0]["text"]


async def test_envoy_restart_is_served_by_the_running_extproc() -> None:
    async with split_topology() as split:
        assert (await post(split.url))[0] == 200
        extproc_pid = split.extproc.pid
        await split.envoy.stop()
        await split.start_envoy()
        await eventually_ok(split.url, within_s=10)
        assert split.extproc.returncode is None and split.extproc.pid == extproc_pid


async def poll(check, what: str, within_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.perf_counter() + within_s
    while not await check():
        if time.perf_counter() > deadline:
            raise AssertionError(f"not seen within {within_s} s: {what}")
        await asyncio.sleep(0.05)


async def test_serve_reloads_its_config_on_sighup_and_keeps_serving() -> None:
    async with split_topology() as split:
        config = yaml.safe_load(split.config_path.read_text())
        config["decode"]["policy"] = "least_request"
        config["dispatch"] = {"probe": False}
        split.config_path.write_text(yaml.safe_dump(config))
        split.extproc.send_signal(signal.SIGHUP)

        async def reloaded() -> bool:
            return "configuration reloaded" in split.log_text()

        await poll(reloaded, "the reload log line")
        assert split.extproc.returncode is None
        assert (await post(split.url))[0] == 200
        split.config_path.write_text("decode: [not, a, pool]\n")
        split.extproc.send_signal(signal.SIGHUP)

        async def refused() -> bool:
            return "reload refused" in split.log_text()

        await poll(refused, "the refused reload")
        assert (await post(split.url))[0] == 200  # the running config was kept


async def test_serve_knows_discovered_members_before_it_answers() -> None:
    """DNS members are resolved before the ready file exists, not one interval later."""
    async with running_engine("--kv-transfer-config", PUSH_D) as extra:
        overrides = {"discovery": {"interval_s": 600}}  # no second round during the test
        async with split_topology(decode_dns=f"localhost:{extra.port}", **overrides) as split:
            decodes = (await split.ready_state())["decode"]
            assert f"127.0.0.1:{extra.port}" in decodes, decodes


async def test_serve_drains_open_streams_on_sigterm_and_is_not_ready_meanwhile() -> None:
    async with split_topology(timeouts={"drain_s": 10}) as split:
        assert (await split.ready())[0] == 200
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 50, "stream": True}
        events: list[bytes] = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(split.url + "/v1/completions", json=body) as response,
        ):
            events.append(await response.content.readline())
            split.extproc.send_signal(signal.SIGTERM)

            async def not_ready() -> bool:
                status, state = await split.ready()
                return status == 503 and state["draining"] is True

            await poll(not_ready, "/ready answering 503 while the stream drains", within_s=5)
            async for line in response.content:
                events.append(line)
        assert response.status == 200
        assert b"data: [DONE]\n" in events  # the open stream finished whole
        assert await asyncio.wait_for(split.extproc.wait(), 15) == 0
