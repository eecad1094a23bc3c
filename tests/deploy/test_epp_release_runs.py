"""The endpoint-picker release of examples/gateway-api-inference, run for real: the config the
chart writes into its ConfigMap (only hosts and ports moved to loopback and ephemeral ones, the
Kubernetes API to a fake) runs `pd-extproc epp`; the InferencePool the chart renders and pods
labelled like the example's engines are served by the fake API (tests/support/kube_api.py);
vllmsim engines play the pods. The chart's probes get SERVING from the health services they
name, and a request through an Envoy configured as Envoy Gateway routes an InferencePool (an
ORIGINAL_DST cluster on the destination header) is served prefill then decode by the pods of
those roles."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.testing import fixed_routing
from tests.support.deploy import one
from tests.support.engines import MODEL
from tests.support.epp import running_epp
from tests.support.examples import build
from tests.support.gateway import Variant, running_gateway
from tests.support.helm import release
from tests.support.kube_api import fake_kube_api, pod
from tests.support.polling import until
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, running_engine

SERVING = health_pb2.HealthCheckResponse.SERVING
PODS = {"vllm-prefill": ["127.0.0.2"], "vllm-decode": ["127.0.0.3", "127.0.0.4"]}


def _shared_port() -> int:
    """A port free on the first pod address: every pod of a pool listens on the target port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        port: int = probe.getsockname()[1]
        return port


def _loopback(config: dict[str, Any], kube_url: str, token: Path) -> dict[str, Any]:
    """The release's config with its listen addresses moved to loopback, ephemeral ports."""
    config["extproc"] |= {"host": "127.0.0.1", "port": 0}
    config["metrics"] |= {"host": "127.0.0.1", "port": 0}
    config["endpoint_picker"] |= {"health_port": 0}
    config["discovery"] = {
        "kubernetes_api": kube_url,
        "token_file": str(token),
        "ca_file": "/nonexistent",
    }
    config["health"] = {"interval_s": 0.5, "timeout_s": 0.5}
    return config


async def _status(port: int, probe: dict[str, Any]) -> int:
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=probe["grpc"]["service"])
        answer = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        return int(answer.status)


async def _seen(session: aiohttp.ClientSession, address: str) -> list[dict[str, Any]]:
    async with session.get(f"http://{address}/sim/requests") as response:
        records: list[dict[str, Any]] = await response.json()
    return [r for r in records if not (r["x_request_id"] or "").startswith("pd-extproc-probe-")]


async def test_release_config_picks_for_the_example_pool_behind_a_gateway(
    kube_bin: Path, tmp_path: Path
) -> None:
    port = _shared_port()
    docs = release(kube_bin, "envoy-gateway", **{"engines.port": str(port)})
    # the release's config, every request through P (short prompts on idle engines would
    # otherwise be served by D alone, and this checks both legs behind the gateway)
    config = fixed_routing(yaml.safe_load(one(docs, "ConfigMap")["data"]["pd-extproc.yaml"]))
    probes = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    labels = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in build(kube_bin, "gateway-api-inference/engines")
    }
    token = tmp_path / "token"
    token.write_text("sa-token")
    async with fake_kube_api() as kube, aiohttp.ClientSession() as session:
        kube.put_pool(one(docs, "InferencePool"))
        for deployment, ips in PODS.items():
            for n, ip in enumerate(ips):
                kube.put_pod(pod(f"{deployment}-{n}", ip, labels[deployment], namespace="llm"))
        prefill, *decodes = [f"{ip}:{port}" for ips in PODS.values() for ip in ips]
        async with (
            running_engine(
                "--kv-transfer-config", PUSH_P, *FAST, "--host", "127.0.0.2", "--port", str(port)
            ),
            running_engine(
                "--kv-transfer-config", PUSH_D, *FAST, "--host", "127.0.0.3", "--port", str(port)
            ),
            running_engine(
                "--kv-transfer-config", PUSH_D, *FAST, "--host", "127.0.0.4", "--port", str(port)
            ),
            running_epp(_loopback(config, kube.url, token)) as picker,
            running_gateway(Variant.ORIGINAL_DST, picker.extproc, [prefill, *decodes]) as url,
        ):

            async def serving(probe: str) -> bool:
                return await _status(picker.health_port, probes[probe]) == SERVING

            await until(lambda: serving("livenessProbe"), "liveness SERVING")
            await until(lambda: serving("readinessProbe"), "readiness SERVING", timeout_s=30)
            body = {"model": MODEL, "prompt": "through the gateway " * 8, "max_tokens": 4}
            for _ in range(4):  # both decodes get some: the pick is the picker's, not Envoy's
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
            assert len(await _seen(session, prefill)) == 4
            assert sum([len(await _seen(session, d)) for d in decodes]) == 4
