"""Envoy and the ext_proc as separate processes (`pd-extproc serve` next to an Envoy):
either can die and come back without the other being restarted."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import aiohttp
import orjson
import yaml

from extproc.process.server import ENVOY_STATS_PATH
from tests.support.engines import MODEL
from tests.support.polling import until
from tests.support.split import split_topology
from vllmsim.launcher import PUSH_D, running_engine

COMPLETION = {"model": MODEL, "prompt": "split processes " * 10, "max_tokens": 4}


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


async def test_serve_reloads_its_config_on_sighup_and_keeps_serving() -> None:
    async with split_topology() as split:
        config = yaml.safe_load(split.config_path.read_text())
        config["decode"]["policy"] = "least_request"
        config["dispatch"] = {"probe": False}
        split.config_path.write_text(yaml.safe_dump(config))
        split.extproc.send_signal(signal.SIGHUP)

        async def reloaded() -> bool:
            return "configuration reloaded" in split.log_text()

        await until(reloaded, "the reload log line")
        assert split.extproc.returncode is None
        assert (await post(split.url))[0] == 200
        split.config_path.write_text("decode: [not, a, pool]\n")
        split.extproc.send_signal(signal.SIGHUP)

        async def refused() -> bool:
            return "reload refused" in split.log_text()

        await until(refused, "the refused reload")
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

            await until(not_ready, "/ready answering 503 while the stream drains", timeout_s=5)
            async for line in response.content:
                events.append(line)
        assert response.status == 200
        assert b"data: [DONE]\n" in events  # the open stream finished whole
        assert await asyncio.wait_for(split.extproc.wait(), 15) == 0


async def test_serve_passes_on_the_stats_of_the_envoy_its_config_names() -> None:
    """The chart's Envoy keeps its admin on loopback: a cluster's Prometheus reads its stats
    from the sidecar's metrics port (the ServiceMonitor's second endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        admin = int(probe.getsockname()[1])
    envoy = {"listen": {"port": 0}, "admin": {"host": "127.0.0.1", "port": admin}}
    async with split_topology(envoy=envoy) as split, aiohttp.ClientSession() as session:
        assert (await post(split.url))[0] == 200
        stats = split.metrics + ENVOY_STATS_PATH
        async with session.get(stats, timeout=aiohttp.ClientTimeout(total=10)) as got:
            assert got.status == 200, await got.text()
            text = await got.text()
        assert 'envoy_cluster_upstream_rq_total{envoy_cluster_name="decode_pool"} 1' in text
        assert split.envoy is not None
        await split.envoy.stop()
        async with session.get(stats, timeout=aiohttp.ClientTimeout(total=10)) as got:
            assert got.status == 502
            assert (await got.text()).startswith(f"Envoy admin http://127.0.0.1:{admin}: ")
