"""Live pool membership behind a user's own Envoy: `pd-extproc serve` plus an Envoy built from
`render-envoy --snippet`, while requests flow and the membership changes (a Kubernetes pod
appears and goes away, or a SIGHUP reload edits the static list). The new engine gets traffic
within 2 s without Envoy restarting; a removed one gets no new requests, and the requests it
had in flight finish. Envoy learns the pools from the ext_proc over EDS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.process.envoy_process import EnvoyProcess
from tests.support.engines import address, engine_requests
from tests.support.kube_api import fake_kube_api, pod
from tests.support.snippet import render, serving_process, users_envoy
from vllmsim.launcher import PUSH_D, PUSH_P, EngineHandle, running_engine

# 20 ms steps: a request of 20 tokens stays in flight for about 0.4 s
ENGINE = ("--step-base-ms", "20", "--prefill-per-token-ms", "0.001", "--decode-per-seq-ms", "0")
SHORT = {"model": "sim-model", "prompt": "live " * 20, "max_tokens": 20}
LONG = {"model": "sim-model", "prompt": "long-running " * 20, "max_tokens": 100}
JOIN_WITHIN_S = 2.0
TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass
class Load:
    """Requests sent back to back by two clients until stopped; every status kept."""

    url: str
    session: aiohttp.ClientSession
    statuses: list[tuple[int, str]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _client(self) -> None:
        while not self._stop.is_set():
            async with self.session.post(
                self.url + "/v1/completions", json=SHORT, timeout=TIMEOUT
            ) as response:
                self.statuses.append((response.status, await response.text()))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        clients = [asyncio.create_task(self._client()) for _ in range(2)]
        try:
            yield self
        finally:
            self._stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 30)

    async def more(self, count: int) -> None:
        """Until `count` more requests have completed."""
        target = len(self.statuses) + count
        await until(lambda: len(self.statuses) >= target, f"{count} more requests")


async def until(
    check: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 15
) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                result = check()
                if result if isinstance(result, bool) else await result:
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"gave up after {timeout_s} s waiting for {what}") from None


async def envoy_hosts(
    session: aiohttp.ClientSession, envoy: EnvoyProcess, cluster: str
) -> set[str]:
    """The members of `cluster` as Envoy's admin lists them."""
    async with session.get(envoy.admin_url + "/clusters") as response:
        lines = (await response.text()).splitlines()
    return {
        line.split("::")[1]
        for line in lines
        if line.startswith(cluster + "::") and line.split("::")[2] == "cx_active"
    }


@dataclass
class Stage:
    """The engines, the serving ext_proc and the user's Envoy."""

    session: aiohttp.ClientSession
    envoy: EnvoyProcess
    url: str
    d1: EngineHandle
    d2: EngineHandle
    serve_pid: int

    async def seen(self, engine: EngineHandle) -> list[dict[str, Any]]:
        return await engine_requests(self.session, engine)

    async def post(self, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.session.post(
            self.url + "/v1/completions", json=body, timeout=TIMEOUT
        ) as response:
            return response.status, await response.json()

    async def envoy_uptime(self) -> int:
        async with self.session.get(self.envoy.admin_url + "/server_info") as response:
            info = await response.json()
        return int(info["uptime_current_epoch"].rstrip("s"))


@contextlib.asynccontextmanager
async def stage(
    tmp_path: Path, config: Callable[[EngineHandle, EngineHandle, EngineHandle], dict[str, Any]]
) -> AsyncIterator[Stage]:
    sock = f"unix:{tmp_path}/prefill.sock"
    async with contextlib.AsyncExitStack() as stack:
        p, d1, d2 = [
            await stack.enter_async_context(running_engine("--kv-transfer-config", kv, *ENGINE))
            for kv in (PUSH_P, PUSH_D, PUSH_D)
        ]
        config_path = tmp_path / "pd-extproc.yaml"
        config_path.write_text(yaml.safe_dump(config(p, d1, d2)))
        extproc, pid = await stack.enter_async_context(
            serving_process(config_path, sock, tmp_path / "serve.log")
        )
        bootstrap = tmp_path / "envoy.yaml"
        bootstrap.write_text(
            yaml.safe_dump(users_envoy(render(config_path, extproc, sock, "--snippet")))
        )
        envoy = EnvoyProcess(bootstrap, tmp_path, "warning", 1)
        await envoy.start()
        stack.push_async_callback(envoy.stop)
        url = "http://" + await envoy.listener_address("ingress")
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield Stage(session, envoy, url, d1, d2, pid)


def base_config(p: EngineHandle, d1: EngineHandle) -> dict[str, Any]:
    return {
        "prefill": {"endpoints": [address(p)]},
        "decode": {"endpoints": [address(d1)], "policy": "round_robin"},
        "extproc": {"host": "127.0.0.1", "port": 0},
        "metrics": {"port": 0},
        "health": {"interval_s": 0.5, "timeout_s": 0.5},
        "discovery": {"interval_s": 0.3},
    }


async def joins_and_leaves(
    stage: Stage, join: Callable[[], None], leave: Callable[[], None]
) -> dict[str, float]:
    """The membership change while requests flow; returns the measured times."""
    envoy_admin = stage.envoy.admin_url  # the same Envoy throughout: never restarted
    d2 = address(stage.d2)
    async with Load(stage.url, stage.session).running() as load:
        await load.more(4)
        assert await stage.seen(stage.d2) == []  # not a member yet
        joined_at = time.time()
        join()

        async def d2_serves() -> bool:
            return bool(await stage.seen(stage.d2))

        await until(d2_serves, "the new engine to get a request")
        first = min(r["received_at"] for r in await stage.seen(stage.d2))
        join_s = first - joined_at
        assert join_s < JOIN_WITHIN_S, f"the new engine's first request came {join_s:.2f} s later"
        assert d2 in await envoy_hosts(stage.session, stage.envoy, "decode_pool")

        # long requests until one runs on the engine that is about to leave
        long_requests: list[asyncio.Task[tuple[int, Any]]] = []

        async def long_one_on_d2() -> bool:
            if len(long_requests) < 8:
                long_requests.append(asyncio.create_task(stage.post(LONG)))
            return any(
                r["outcome"] == "running" and "long-running" in r["body"]["prompt"]
                for r in await stage.seen(stage.d2)
                if r["body"]
            )

        await until(long_one_on_d2, "a long request running on the leaving engine")
        left_at = time.time()
        leave()

        async def envoy_dropped_it() -> bool:
            return d2 not in await envoy_hosts(stage.session, stage.envoy, "decode_pool")

        await until(envoy_dropped_it, "Envoy to drop the engine that left")
        leave_s = time.time() - left_at
        count = len(await stage.seen(stage.d2))
        await load.more(8)
        for status, body in await asyncio.gather(*long_requests):  # in flight at the removal
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == LONG["max_tokens"]  # finished, whole
        after = await stage.seen(stage.d2)
        assert len(after) == count, "the engine that left got new requests"
    assert all(r["outcome"] == "ok" for r in after), [r["outcome"] for r in after]
    failed = [s for s in load.statuses if s[0] != 200]
    assert not failed, failed[:3]
    assert stage.envoy.admin_url == envoy_admin and await stage.envoy_uptime() > 0
    return {"join_s": join_s, "leave_s": leave_s, "requests": len(load.statuses)}


@pytest.mark.timeout(180)
async def test_kubernetes_pods_reach_the_users_envoy(tmp_path: Path) -> None:
    async with fake_kube_api() as kube:

        def config(p: EngineHandle, d1: EngineHandle, d2: EngineHandle) -> dict[str, Any]:
            cfg = base_config(p, d1)
            cfg["decode"]["kubernetes"] = {"label_selector": "app=decode", "port": d2.port}
            cfg["discovery"] |= {
                "kubernetes_api": kube.url,
                "token_file": "/nonexistent",
                "ca_file": "/nonexistent",
            }
            return cfg

        async with stage(tmp_path, config) as s:
            times = await joins_and_leaves(
                s,
                lambda: kube.put_pod(pod("d-2", "127.0.0.1", {"app": "decode"})),
                lambda: kube.delete_pod("d-2"),
            )
    print(f"kubernetes: {times}")


@pytest.mark.timeout(180)
async def test_a_reload_reaches_the_users_envoy(tmp_path: Path) -> None:
    config_path = tmp_path / "pd-extproc.yaml"

    def config(p: EngineHandle, d1: EngineHandle, d2: EngineHandle) -> dict[str, Any]:
        return base_config(p, d1)

    async with stage(tmp_path, config) as s:

        def set_decodes(*engines: EngineHandle) -> None:
            cfg = yaml.safe_load(config_path.read_text())
            cfg["decode"]["endpoints"] = [address(e) for e in engines]
            config_path.write_text(yaml.safe_dump(cfg))
            os.kill(s.serve_pid, signal.SIGHUP)

        times = await joins_and_leaves(
            s, lambda: set_decodes(s.d1, s.d2), lambda: set_decodes(s.d1)
        )
    print(f"reload: {times}")


@pytest.mark.timeout(120)
async def test_envoy_keeps_the_pools_while_the_extproc_restarts(tmp_path: Path) -> None:
    """While no ext_proc answers, Envoy keeps the members it had; a restarted ext_proc (same
    address) hands it the current ones without Envoy restarting. Stopping the ext_proc is not
    held up by Envoy's EDS stream, which never ends by itself."""
    sock, extproc_sock = f"unix:{tmp_path}/prefill.sock", f"unix:{tmp_path}/extproc.sock"
    fast = ("--step-base-ms", "1", "--prefill-per-token-ms", "0.001", "--decode-per-seq-ms", "0")
    config_path = tmp_path / "pd-extproc.yaml"
    async with contextlib.AsyncExitStack() as stack:
        p, d1, d2 = [
            await stack.enter_async_context(running_engine("--kv-transfer-config", kv, *fast))
            for kv in (PUSH_P, PUSH_D, PUSH_D)
        ]
        config = base_config(p, d1)
        config["extproc"] = {"host": extproc_sock}
        config["timeouts"] = {"drain_s": 10}
        config_path.write_text(yaml.safe_dump(config))
        first = contextlib.AsyncExitStack()
        extproc, _ = await first.enter_async_context(
            serving_process(config_path, sock, tmp_path / "serve-1.log")
        )
        bootstrap = tmp_path / "envoy.yaml"
        bootstrap.write_text(
            yaml.safe_dump(users_envoy(render(config_path, extproc, sock, "--snippet")))
        )
        envoy = EnvoyProcess(bootstrap, tmp_path, "warning", 1)
        await envoy.start()
        stack.push_async_callback(envoy.stop)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        s = Stage(session, envoy, "http://" + await envoy.listener_address("ingress"), d1, d2, 0)
        status, body = await s.post(SHORT)
        assert status == 200, body

        stopping = time.perf_counter()
        await first.aclose()  # SIGTERM; the drain waits for requests only (drain_s 10)
        assert time.perf_counter() - stopping < 5
        assert await envoy_hosts(session, envoy, "decode_pool") == {address(d1)}

        config["decode"]["endpoints"] = [address(d2)]
        config_path.write_text(yaml.safe_dump(config))
        async with serving_process(config_path, sock, tmp_path / "serve-2.log"):
            restarted = time.perf_counter()

            async def envoy_follows() -> bool:
                return await envoy_hosts(session, envoy, "decode_pool") == {
                    address(d2)
                } and await envoy_hosts(session, envoy, "prefill_pool") == {address(p)}

            await until(envoy_follows, "Envoy to take the restarted ext_proc's members")
            print(
                f"Envoy had the new members {time.perf_counter() - restarted:.2f} s after "
                "the ext_proc restarted"
            )
            status, body = await s.post(SHORT)
            assert status == 200, body
            assert len(await s.seen(d2)) == 1


@pytest.mark.timeout(120)
async def test_an_envoy_started_before_the_extproc_waits_at_most_seconds(tmp_path: Path) -> None:
    """A user's Envoy (its other routes too) is not held for Envoy's default 15 s when the
    ext_proc is not up yet; the pools fill once it is."""
    sock, extproc_sock = f"unix:{tmp_path}/prefill.sock", f"unix:{tmp_path}/extproc.sock"
    fast = ("--step-base-ms", "1", "--prefill-per-token-ms", "0.001", "--decode-per-seq-ms", "0")
    config_path = tmp_path / "pd-extproc.yaml"
    async with contextlib.AsyncExitStack() as stack:
        p, d = [
            await stack.enter_async_context(running_engine("--kv-transfer-config", kv, *fast))
            for kv in (PUSH_P, PUSH_D)
        ]
        config = base_config(p, d) | {"extproc": {"host": extproc_sock}}
        config_path.write_text(yaml.safe_dump(config))
        bootstrap = tmp_path / "envoy.yaml"
        bootstrap.write_text(
            yaml.safe_dump(users_envoy(render(config_path, extproc_sock, sock, "--snippet")))
        )
        envoy = EnvoyProcess(bootstrap, tmp_path, "warning", 1)
        started = time.perf_counter()
        await envoy.start()  # returns once Envoy is ready: its pools' first fetch settled
        ready_s = time.perf_counter() - started
        stack.push_async_callback(envoy.stop)
        print(f"Envoy ready {ready_s:.2f} s after it started, without an ext_proc")
        assert ready_s < 10
        session = await stack.enter_async_context(aiohttp.ClientSession())
        assert await envoy_hosts(session, envoy, "decode_pool") == set()
        await stack.enter_async_context(serving_process(config_path, sock, tmp_path / "s.log"))

        async def pools_filled() -> bool:
            return await envoy_hosts(session, envoy, "decode_pool") == {
                address(d)
            } and await envoy_hosts(session, envoy, "prefill_pool") == {address(p)}

        await until(pools_filled, "Envoy to take the members once the ext_proc is up")
        s = Stage(session, envoy, "http://" + await envoy.listener_address("ingress"), d, d, 0)
        status, body = await s.post(SHORT)
        assert status == 200, body
