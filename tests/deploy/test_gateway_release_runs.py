"""The gateway-mode release, run for real: the config the chart writes into its ConfigMap
(listen hosts moved to loopback, ports to free ones, the Kubernetes API to a fake serving pods
labelled like examples/gateway-api-inference's engines), `pd-extproc serve` as the pod's
container runs it, and Envoy with the bootstrap the init container's own command renders.
vllmsim engines play the pods. Requests through Envoy's ingress are served; a decode pod that
joins gets traffic within 2 s and one that is terminating gets no new requests, Envoy never
restarted (its pools come over gRPC EDS from the ext_proc)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from extproc.process.envoy_process import EnvoyProcess
from tests.support.deploy import one
from tests.support.engines import MODEL
from tests.support.examples import build
from tests.support.helm import container, render
from tests.support.kube_api import fake_kube_api, pod
from tests.support.polling import until
from tests.support.snippet import serving_process
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, running_engine

PREFILL, DECODE_1, DECODE_2 = "127.0.0.2", "127.0.0.3", "127.0.0.4"


def _free_ports(host: str, count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for each in sockets:
            each.bind((host, 0))
        return [each.getsockname()[1] for each in sockets]


async def _seen(session: aiohttp.ClientSession, address: str) -> int:
    async with session.get(f"http://{address}/sim/requests") as response:
        records: list[dict[str, Any]] = await response.json()
    return sum(1 for r in records if not (r["x_request_id"] or "").startswith("pd-extproc-probe-"))


async def test_gateway_release_follows_pods_without_restarting_envoy(
    kube_bin: Path, tmp_path: Path
) -> None:
    [engine_port] = _free_ports(PREFILL, 1)
    http, admin, extproc, prefill_listener, metrics = _free_ports("127.0.0.1", 5)
    docs = render(
        kube_bin,
        "gateway",
        **{
            "ports.http": str(http),
            "ports.envoyAdmin": str(admin),
            "ports.extproc": str(extproc),
            "ports.prefillListener": str(prefill_listener),
            "ports.metrics": str(metrics),
            "engines.port": str(engine_port),
            "config.envoy.listen.host": "127.0.0.1",
            "config.metrics.host": "127.0.0.1",
        },
    )
    config = yaml.safe_load(one(docs, "ConfigMap")["data"]["pd-extproc.yaml"])
    (tmp_path / "pd-extproc.yaml").write_text(yaml.safe_dump(config))
    _, _, script = container(docs, "render-envoy")["command"]
    command, _, _ = script.partition(" > ")
    argv = shlex.split(command.replace("/etc/pd-extproc/", f"{tmp_path}/"))
    argv[0] = str(Path(sys.executable).parent / argv[0])
    rendered = await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, check=True, timeout=60
    )
    (tmp_path / "envoy.yaml").write_text(rendered.stdout)
    labels = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in build(kube_bin, "gateway-api-inference/engines")
    }
    token = tmp_path / "token"
    token.write_text("sa-token")
    sent = itertools.count()
    async with fake_kube_api() as kube, aiohttp.ClientSession() as session:
        config["discovery"] = {
            "kubernetes_api": kube.url,
            "token_file": str(token),
            "ca_file": "/nonexistent",
        }
        config["health"] = {"interval_s": 0.5, "timeout_s": 0.5}
        (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))

        def put(name: str, ip: str, role: str, **state: Any) -> None:
            kube.put_pod(pod(name, ip, labels[f"vllm-{role}"], namespace="llm", **state))

        put("p-0", PREFILL, "prefill")
        put("d-1", DECODE_1, "decode")
        run_dir = tmp_path / "envoy"
        run_dir.mkdir()
        envoy = EnvoyProcess(tmp_path / "envoy.yaml", run_dir, "warning", 1)
        async with (
            running_engine(
                "--kv-transfer-config", PUSH_P, *FAST, "--host", PREFILL, "--port", str(engine_port)
            ),
            running_engine(
                "--kv-transfer-config",
                PUSH_D,
                *FAST,
                "--host",
                DECODE_1,
                "--port",
                str(engine_port),
            ),
            running_engine(
                "--kv-transfer-config",
                PUSH_D,
                *FAST,
                "--host",
                DECODE_2,
                "--port",
                str(engine_port),
            ),
            serving_process(
                tmp_path / "serve.yaml", config["envoy"]["prefill_listener"], tmp_path / "serve.log"
            ),
        ):
            await envoy.start()
            try:
                url = f"http://127.0.0.1:{http}/v1/completions"

                async def served() -> bool:
                    # a new prompt each time: the default routing keeps a repeated one on
                    # the D that holds it, and the pod that joins holds none
                    prompt = f"request {next(sent)} through the release " * 8
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                    async with session.post(url, json=body) as response:
                        await response.read()
                        return response.status == 200

                await until(served, "a request served through the release", timeout_s=30)
                d2 = f"{DECODE_2}:{engine_port}"
                put("d-2", DECODE_2, "decode")  # joins

                async def d2_gets_traffic() -> bool:
                    assert await served()
                    return await _seen(session, d2) > 0

                await until(d2_gets_traffic, "traffic on the pod that joined", timeout_s=2)
                put("d-2", DECODE_2, "decode", terminating=True)
                d1 = f"{DECODE_1}:{engine_port}"

                async def d2_left() -> bool:
                    before = await _seen(session, d2)
                    for _ in range(4):
                        assert await served()
                    return await _seen(session, d2) == before

                await until(d2_left, "no new requests on the terminating pod", timeout_s=10)
                assert await _seen(session, d1) > 0
            finally:
                await envoy.stop()
