"""Pool membership at run time: DNS, Kubernetes pods, SIGHUP reload — and Envoy follows."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest_asyncio
import yaml
from aiohttp import web

from extproc.testing import ephemeral_config, running_sidecar
from tests.integration.conftest import MODEL, Topology, address, topology, until
from vllmsim.launcher import PUSH_D, PUSH_P, running_engine

COMPLETION = {"model": MODEL, "prompt": "discovered " * 10, "max_tokens": 2}


class FakeKubernetes:
    """Just enough of the Kubernetes API: list pods by label selector."""

    def __init__(self) -> None:
        self.pods: dict[str, list[str]] = {}  # selector → pod IPs
        self.auth: set[str] = set()

    async def list_pods(self, request: web.Request) -> web.Response:
        self.auth.add(request.headers.get("authorization", ""))
        ips = self.pods.get(request.query.get("labelSelector", ""), [])
        items = [{"status": {"phase": "Running", "podIP": ip,
                             "conditions": [{"type": "Ready", "status": "True"}]}}
                 for ip in ips]  # fmt: skip
        return web.json_response({"kind": "PodList", "items": items})


@pytest_asyncio.fixture
async def fake_kubernetes() -> AsyncIterator[tuple[FakeKubernetes, str]]:
    fake = FakeKubernetes()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{namespace}/pods", fake.list_pods)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_dns_name_resolves_to_the_pool() -> None:
    async with (
        running_engine("--kv-transfer-config", PUSH_P) as p,
        running_engine("--kv-transfer-config", PUSH_D) as d,
    ):
        config = ephemeral_config([address(p)], [])
        config["decode"] = {"dns": f"localhost:{d.port}"}  # a headless-service style name
        async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:
            async with session.post(sidecar.url + "/v1/completions", json=COMPLETION) as r:
                assert r.status == 200, await r.text()
            async with session.get(sidecar.metrics + "/ready") as r:
                ready = await r.json()
        assert ready["decode"][address(d)]["healthy"] is True


async def test_kubernetes_pods_join_and_leave(
    tmp_path: Path, fake_kubernetes: tuple[FakeKubernetes, str]
) -> None:
    fake, api = fake_kubernetes
    token = tmp_path / "token"
    token.write_text("secret-token")
    async with (
        running_engine("--kv-transfer-config", PUSH_P) as p,
        running_engine("--kv-transfer-config", PUSH_D) as d,
    ):
        fake.pods = {"role=prefill": ["127.0.0.1"], "role=decode": ["127.0.0.1"]}
        config = ephemeral_config([], [])
        config["prefill"] = {"kubernetes": {"label_selector": "role=prefill", "port": p.port}}
        config["decode"] = {"kubernetes": {"label_selector": "role=decode", "port": d.port}}
        config["discovery"] = {"interval_s": 0.3, "kubernetes_api": api,
                               "token_file": str(token), "ca_file": "/nonexistent"}  # fmt: skip
        async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:
            topo = Topology([p], [d], sidecar, session)
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
            assert fake.auth == {"Bearer secret-token"}
            fake.pods["role=prefill"] = []  # the prefill pod goes away

            async def prefill_gone() -> bool:
                ready = await topo.ready()
                return not ready["prefill"] and not ready["identities"]

            await until(prefill_gone, "the prefill pod to leave the pool")
            status, _, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 503  # no prefill: retryable error, not a hang
            fake.pods["role=prefill"] = ["127.0.0.1"]  # and comes back

            async def prefill_back() -> bool:
                ready = await topo.ready()
                return ready["prefill"].get(address(p), {}).get("healthy") is True

            await until(prefill_back, "the prefill pod to rejoin")
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body


async def test_sighup_reload_adds_an_endpoint_without_dropping_requests() -> None:
    async with (
        topology(n_decode=1, engine_flags=("--step-base-ms", "30")) as topo,
        running_engine("--kv-transfer-config", PUSH_D) as extra,
    ):
        config = yaml.safe_load(topo.sidecar.config_path.read_text())
        config["decode"]["endpoints"].append(address(extra))
        config["decode"]["policy"] = "round_robin"
        topo.sidecar.config_path.write_text(yaml.safe_dump(config))
        slow = asyncio.create_task(
            topo.post("/v1/completions", COMPLETION | {"max_tokens": 30, "stream": True})
        )

        async def slow_in_flight() -> bool:
            return len(await topo.seen(topo.decodes[0])) == 1

        await until(slow_in_flight, "the slow request to reach its decode")
        os.kill(topo.sidecar.pid, signal.SIGHUP)

        async def both_healthy() -> bool:
            decode = (await topo.ready())["decode"]
            return len(decode) == 2 and all(e["healthy"] for e in decode.values())

        await until(both_healthy, "the new decode endpoint")
        status, _, _ = await slow
        assert status == 200  # the request in flight during the reload finished
        for _ in range(4):
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
        assert len(await topo.seen(extra)) >= 1  # Envoy routes to the new member too
        # a broken config is refused and the running one kept
        topo.sidecar.config_path.write_text("decode: {endpoints: [nope]}\n")
        os.kill(topo.sidecar.pid, signal.SIGHUP)
        await until(
            lambda: asyncio.sleep(0, "reload refused" in topo.sidecar.log_text()),
            "the refused reload",
        )
        status, _, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200


async def test_a_reload_reaches_every_worker_and_envoy() -> None:
    """Each ext_proc worker serves Envoy the pools over EDS, so all must take a reload: Envoy's
    stream may sit on any of them."""
    async with (
        topology(extproc={"workers": 2}) as topo,
        running_engine("--kv-transfer-config", PUSH_D) as extra,
    ):
        config = yaml.safe_load(topo.sidecar.config_path.read_text())
        config["decode"]["endpoints"].append(address(extra))
        topo.sidecar.config_path.write_text(yaml.safe_dump(config))
        os.kill(topo.sidecar.pid, signal.SIGHUP)

        async def everywhere() -> bool:
            for base in [topo.sidecar.metrics, *topo.sidecar.worker_metrics]:
                async with topo.session.get(base + "/ready") as response:
                    if address(extra) not in (await response.json())["decode"]:
                        return False
            async with topo.session.get(topo.sidecar.envoy_admin + "/clusters") as response:
                return f"decode_pool::{address(extra)}::" in await response.text()

        await until(everywhere, "every worker and Envoy to take the new decode endpoint")
