"""Pool membership at run time: DNS, Kubernetes pods (watched), SIGHUP reload — and Envoy
follows."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import yaml

from extproc.testing import ephemeral_config, running_sidecar
from tests.support.engines import MODEL, address
from tests.support.kube_api import fake_kube_api, pod
from tests.support.polling import until
from tests.support.topology import Topology, topology
from vllmsim.launcher import PUSH_D, PUSH_P, running_engine

COMPLETION = {"model": MODEL, "prompt": "discovered " * 10, "max_tokens": 2}


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
            async with session.get(sidecar.metrics + "/ready?verbose") as r:
                ready = await r.json()
        assert ready["decode"][address(d)]["healthy"] is True


async def test_kubernetes_pods_join_and_leave(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret-token")
    async with (
        fake_kube_api() as kube,
        running_engine("--kv-transfer-config", PUSH_P) as p,
        running_engine("--kv-transfer-config", PUSH_D) as d,
    ):
        kube.put_pod(pod("prefill-0", "127.0.0.1", {"role": "prefill"}))
        kube.put_pod(pod("decode-0", "127.0.0.1", {"role": "decode"}))
        config = ephemeral_config([], [])
        config["prefill"] = {"kubernetes": {"label_selector": "role=prefill", "port": p.port}}
        config["decode"] = {"kubernetes": {"label_selector": "role=decode", "port": d.port}}
        config["discovery"] = {
            "kubernetes_api": kube.url,
            "token_file": str(token),
            "ca_file": "/nonexistent",
        }
        async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:
            topo = Topology([p], [d], sidecar, session)
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
            assert {r["auth"] for r in kube.requests} == {"Bearer secret-token"}
            kube.delete_pod("prefill-0")  # the prefill pod goes away

            async def prefill_gone() -> bool:
                ready = await topo.ready()
                return not ready["prefill"] and not ready["identities"]

            await until(prefill_gone, "the prefill pod to leave the pool")
            status, _, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 503  # no prefill: retryable error, not a hang
            kube.put_pod(pod("prefill-0", "127.0.0.1", {"role": "prefill"}))  # and comes back

            async def prefill_back() -> bool:
                ready = await topo.ready()
                return ready["prefill"].get(address(p), {}).get("healthy") is True

            await until(prefill_back, "the prefill pod to rejoin")
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
            assert len(kube.lists("pods")) == 2  # one per selector: then only watches


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
                async with topo.session.get(base + "/ready?verbose") as response:
                    if address(extra) not in (await response.json())["decode"]:
                        return False
            async with topo.session.get(topo.sidecar.envoy_admin + "/clusters") as response:
                return f"decode_pool::{address(extra)}::" in await response.text()

        await until(everywhere, "every worker and Envoy to take the new decode endpoint")
