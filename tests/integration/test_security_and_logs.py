"""TLS (and mTLS) between Envoy and the ext_proc, its gRPC health service, JSON logs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import orjson
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.engines import MODEL
from tests.support.topology import topology

COMPLETION = {"model": MODEL, "prompt": "secure " * 10, "max_tokens": 2}


def tls_files(tmp_path: Path, mutual: bool) -> dict[str, str]:
    ca = trustme.CA()
    server = ca.issue_cert("localhost")
    files = {
        "ca_file": tmp_path / "ca.pem",
        "cert_file": tmp_path / "server.pem",
        "key_file": tmp_path / "server.key",
    }
    ca.cert_pem.write_to_path(files["ca_file"])
    server.cert_chain_pems[0].write_to_path(files["cert_file"])
    server.private_key_pem.write_to_path(files["key_file"])
    if mutual:
        client = ca.issue_cert("envoy")
        files["client_cert_file"] = tmp_path / "client.pem"
        files["client_key_file"] = tmp_path / "client.key"
        client.cert_chain_pems[0].write_to_path(files["client_cert_file"])
        client.private_key_pem.write_to_path(files["client_key_file"])
    return {key: str(path) for key, path in files.items()}


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
async def test_envoy_talks_to_the_extproc_over_tls(tmp_path: Path, mutual: bool) -> None:
    tls = tls_files(tmp_path, mutual)
    async with topology(extproc={"tls": tls}) as topo:
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        # a client without TLS gets nowhere
        async with grpc.aio.insecure_channel(topo.sidecar.extproc) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
        # a TLS client that trusts the server but has no certificate: refused under mTLS only
        ca = await asyncio.to_thread(Path(tls["ca_file"]).read_bytes)
        server_ca = grpc.ssl_channel_credentials(ca)
        name = [("grpc.ssl_target_name_override", "localhost")]
        async with grpc.aio.secure_channel(topo.sidecar.extproc, server_ca, name) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
            if mutual:
                with pytest.raises(grpc.aio.AioRpcError):
                    await check
            else:
                assert (await check).status == health_pb2.HealthCheckResponse.SERVING


async def test_extproc_serves_grpc_health_and_envoy_checks_it() -> None:
    async with topology() as topo:
        async with grpc.aio.insecure_channel(topo.sidecar.extproc) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            service = "envoy.service.ext_proc.v3.ExternalProcessor"
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        stat = "cluster.pd_extproc.health_check.success"
        async with topo.session.get(f"{topo.sidecar.envoy_admin}/stats?filter={stat}") as response:
            line = (await response.text()).strip()
        assert line.startswith(stat) and int(line.rpartition(" ")[2]) >= 1, line


async def test_json_logs_carry_request_fields() -> None:
    async with topology(log={"format": "json", "requests": True}) as topo:
        status, _, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200
        await topo.metrics()  # waits for the request to be fully counted (and logged)
        lines = [
            orjson.loads(line)
            for line in topo.sidecar.log_text().splitlines()
            if line.startswith("{")
        ]
        done = [line for line in lines if line.get("outcome") == "ok"]
        assert done, lines[-5:]
        assert done[0]["strategy"] == "parallel" and done[0]["reason"] == "cache_hit"
        assert len(done[0]["request_id"]) == 36 and done[0]["level"] == "INFO"


async def test_otel_spans_split_a_request_into_its_legs(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiohttp import web

    spans: list[dict] = []

    async def collect(request: web.Request) -> web.Response:
        export = orjson.loads(await request.read())  # OTLP/HTTP JSON
        for resource in export["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                spans.extend(scope["spans"])
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/traces", collect)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    endpoint = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces"
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s
    try:
        async with topology(tracing={"enabled": True, "endpoint": endpoint}) as topo:
            status, _, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200
            for _ in range(100):
                if {"pd.request", "pd.prefill_leg"} <= {s["name"] for s in spans}:
                    break
                await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
    by_name = {s["name"]: s for s in spans if s["name"].startswith("pd.")}
    root = by_name["pd.request"]
    assert by_name["pd.prefill_leg"]["parentSpanId"] == root["spanId"]
    assert by_name["pd.decode_first_response"]["parentSpanId"] == root["spanId"]
    attributes = {a["key"]: a["value"].get("stringValue") for a in root["attributes"]}
    assert attributes["pd.strategy"] == "parallel" and attributes["pd.outcome"] == "ok"
