"""An InferencePool and its pods, watched through the fake Kubernetes API, steer real traffic.

`pd-extproc up` (Envoy + ext_proc) discovers its engines from an InferencePool served by
tests/support/kube_api.py; vllmsim engines play the pods. Every pod of a pool shares the pool's
target port and differs by IP, so each simulated pod listens on its own loopback address
(127.0.0.2, .3, ...; nothing leaves the host) and one shared port. Each step (the pool
created, a pod joining, turning not ready, terminating, leaving) is checked in routing: which
engines the requests reach, by the simulators' request records.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.testing import ephemeral_config, running_sidecar
from tests.support.engines import MODEL
from tests.support.kube_api import fake_kube_api, inference_pool, pod
from tests.support.polling import until
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, running_engine

COMPLETION = {"model": MODEL, "prompt": "watched " * 10, "max_tokens": 2}
ROLE = "llm-d.ai/role"
LABELS = {"app": "sim-llm"}


@dataclass(frozen=True)
class Pod:
    name: str
    ip: str
    role: str

    def address(self, port: int) -> str:
        return f"{self.ip}:{port}"


def _shared_port() -> int:
    """A port free on the first simulated pod address (the others are unused addresses)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def pod_engine(ip: str, port: int, kv: str) -> AsyncIterator[None]:
    async with running_engine("--kv-transfer-config", kv, *FAST, "--host", ip, "--port", str(port)):
        yield


async def _seen(session: aiohttp.ClientSession, address: str) -> int:
    async with session.get(f"http://{address}/sim/requests") as response:
        records: list[dict[str, Any]] = await response.json()
    return sum(1 for r in records if not (r["x_request_id"] or "").startswith("pd-extproc-probe-"))


async def test_inference_pool_pods_join_turn_unready_terminate_and_leave(tmp_path: Path) -> None:
    port = _shared_port()
    prefill, d1, d2 = (
        Pod("p-0", "127.0.0.2", "prefill"),
        Pod("d-1", "127.0.0.3", "decode"),
        Pod("d-2", "127.0.0.4", "decode"),
    )
    token = tmp_path / "token"
    token.write_text("sa-token")
    async with (
        fake_kube_api() as kube,
        pod_engine(prefill.ip, port, PUSH_P),
        pod_engine(d1.ip, port, PUSH_D),
        pod_engine(d2.ip, port, PUSH_D),
    ):

        def put(p: Pod, **state: Any) -> None:
            kube.put_pod(pod(p.name, p.ip, {**LABELS, ROLE: p.role}, **state))

        put(prefill)
        put(d1)
        source = {"inference_pool": {"name": "llama"}}
        config = ephemeral_config([], [])
        config["prefill"], config["decode"] = source, {**source, "policy": "round_robin"}
        config["discovery"] = {
            "kubernetes_api": kube.url,
            "token_file": str(token),
            "ca_file": "/nonexistent",
        }
        async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:

            async def post() -> int:
                async with session.post(sidecar.url + "/v1/completions", json=COMPLETION) as r:
                    await r.read()
                    return r.status

            async def decode_pool() -> dict[str, Any]:
                async with session.get(sidecar.metrics + "/ready?verbose") as r:
                    ready: dict[str, Any] = await r.json()
                return ready["decode"]

            async def healthy(*pods: Pod) -> bool:
                pool = await decode_pool()
                wanted = {p.address(port) for p in pods}
                return set(pool) == wanted and all(pool[a]["healthy"] for a in wanted)

            assert await post() == 503  # no InferencePool yet: no engines, a clear error
            kube.put_pool(inference_pool("llama", LABELS, port))
            await until(lambda: healthy(d1), "the pool's decode pod")
            assert await post() == 200
            assert {r["auth"] for r in kube.requests} == {"Bearer sa-token"}

            async def both_get_traffic() -> bool:
                assert await post() == 200
                return await _seen(session, d2.address(port)) > 0

            put(d2)  # joins
            await until(lambda: healthy(d1, d2), "d-2 to join")
            await until(both_get_traffic, "traffic on d-2 after it joined")

            async def no_new_traffic_on_d2(**state: Any) -> None:
                put(d2, **state)
                await until(lambda: healthy(d1), f"d-2 out of the pool ({state})")
                before, d1_before = (
                    await _seen(session, d2.address(port)),
                    await _seen(session, d1.address(port)),
                )
                for _ in range(4):
                    assert await post() == 200
                assert await _seen(session, d2.address(port)) == before
                assert await _seen(session, d1.address(port)) == d1_before + 4

            await no_new_traffic_on_d2(ready=False)  # not ready
            put(d2)  # ready again
            await until(lambda: healthy(d1, d2), "d-2 back")
            await until(both_get_traffic, "traffic on d-2 again")
            await no_new_traffic_on_d2(terminating=True)  # deletionTimestamp set
            kube.delete_pod("d-2")  # and gone
            await until(lambda: healthy(d1), "d-2 to stay out once deleted")
            assert await post() == 200
            assert "watch failed" not in sidecar.log_text()


def _hostile(hazard: str) -> dict[str, Any]:
    """What the API hands over besides the sound objects, by `hazard`."""
    broken = pod("broken", "127.0.0.1", {**LABELS, "tier": "prefill", ROLE: "prefill"})
    if hazard == "pod ip 999.1.1.1":
        broken["status"]["podIP"] = "999.1.1.1"
    elif hazard == "conditions as an object":
        broken["status"]["conditions"] = {"type": "Ready", "status": "True"}
    return broken


@pytest.mark.parametrize(
    "hazard", ["pod ip 999.1.1.1", "conditions as an object", "target ports 70000 and -5"]
)
async def test_a_malformed_object_stops_neither_the_start_nor_the_other_pool(
    tmp_path: Path, hazard: str
) -> None:
    """Prefill by label selector, decode from an InferencePool; one bad object in either must
    not end `up` at start, nor keep Envoy (EDS) from either pool's engines."""
    async with (
        fake_kube_api() as kube,
        running_engine("--kv-transfer-config", PUSH_P) as p,
        running_engine("--kv-transfer-config", PUSH_D) as d,
    ):
        kube.put_pod(pod("p-0", "127.0.0.1", {**LABELS, "tier": "prefill", ROLE: "prefill"}))
        kube.put_pod(pod("d-0", "127.0.0.1", {**LABELS, ROLE: "decode"}))
        pool = inference_pool("llama", LABELS, d.port)
        if hazard.startswith("target ports"):
            pool["spec"]["targetPorts"] = [{"number": 70000}, {"number": -5}, {"number": d.port}]
        else:
            kube.put_raw("pods", "broken", _hostile(hazard))
        kube.put_pool(pool)
        config = ephemeral_config([], [])
        config["prefill"] = {"kubernetes": {"label_selector": "tier=prefill", "port": p.port}}
        config["decode"] = {"inference_pool": {"name": "llama"}}
        config["discovery"] = {"kubernetes_api": kube.url, "ca_file": "/nonexistent"}
        async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:

            async def envoy_has_both() -> bool:
                async with session.get(sidecar.envoy_admin + "/clusters") as response:
                    clusters = await response.text()
                return all(
                    f"{pool}_pool::127.0.0.1:{engine.port}::health_flags::healthy" in clusters
                    for pool, engine in (("prefill", p), ("decode", d))
                )

            await until(envoy_has_both, "both pools' engines in Envoy, over EDS")
            async with session.post(sidecar.url + "/v1/completions", json=COMPLETION) as r:
                assert r.status == 200, await r.text()
            log = sidecar.log_text()
        assert "Traceback" not in log
        if hazard.startswith("target ports"):
            assert log.count("targetPorts 70000, -5 refused") == 1, log
        else:  # seen by both watches (prefill's selector, the pool's): one line
            assert log.count("pods default/broken skipped, malformed") == 1, log
        assert "rejected endpoints" not in log  # Envoy took every EDS answer
