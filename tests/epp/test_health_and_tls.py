"""The endpoint picker's gRPC health services and its TLS port, through real gRPC clients."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
import trustme
from envoy.config.core.v3 import base_pb2 as core
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.process.grpc_health import EXTPROC_SERVICE, HealthServices, health_server
from tests.support.engines import PUSH, address
from tests.support.envoy_feeds import REFUSED, pool_members, send_access_log
from tests.support.epp import Picker, epp_config, running_epp
from tests.support.polling import until
from vllmsim.launcher import running_engine

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROTOCOL_SERVICES = ("liveness", "readiness", EXTPROC_SERVICE, "inference-extension")


async def status(channel: aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(answer.status)


def tls_channel(target: str) -> aio.Channel:
    """Trust the certificate the picker presents (a gateway does not check it at all)."""
    host, _, port = target.rpartition(":")
    pem = ssl.get_server_certificate((host, int(port)))
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    options = (("grpc.ssl_target_name_override", "localhost"),)
    return aio.secure_channel(target, credentials, options)


@pytest.fixture
async def picker() -> AsyncIterator[Picker]:
    async with (
        running_engine("--kv-transfer-config", PUSH[0]) as prefill,
        running_engine("--kv-transfer-config", PUSH[1]) as decode,
        running_epp(
            epp_config([address(prefill)], [address(decode)], timeouts={"drain_s": 5})
        ) as picker,
    ):
        yield picker


async def test_health_services_serve_on_the_plaintext_port_and_the_tls_port(
    picker: Picker,
) -> None:
    async with aio.insecure_channel(f"127.0.0.1:{picker.health_port}") as channel:
        for service in PROTOCOL_SERVICES:
            assert await status(channel, service) == SERVING, service
    async with tls_channel(picker.extproc) as channel:
        for service in PROTOCOL_SERVICES:
            assert await status(channel, service) == SERVING, service


ANY_CLIENT = "accepts any client that reaches it (no client certificate is checked)"


async def test_a_picker_without_a_client_ca_says_so_at_start(picker: Picker) -> None:
    lines = picker.log_path.read_text().splitlines()
    warned = [line for line in lines if ANY_CLIENT in line]
    assert len(warned) == 1 and " WARNING " in warned[0], lines
    assert "endpoint_picker.client_ca_file" in warned[0]


async def test_the_extproc_port_speaks_only_tls(picker: Picker) -> None:
    async with aio.insecure_channel(picker.extproc) as channel:
        with pytest.raises(aio.AioRpcError) as refused:
            await status(channel, "liveness")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_draining_turns_readiness_off_while_a_request_is_open(picker: Picker) -> None:
    async with (
        tls_channel(picker.extproc) as tls,
        aio.insecure_channel(f"127.0.0.1:{picker.health_port}") as health,
    ):
        stream = ep_grpc.ExternalProcessorStub(tls).Process()
        headers = core.HeaderMap(
            headers=[
                core.HeaderValue(key=":method", value="POST"),
                core.HeaderValue(key=":path", value="/v1/completions"),
            ]
        )
        await stream.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=headers)))
        await until(lambda: open_streams(picker, 1), "the picker holding the request open")
        os.kill(picker.pid, signal.SIGTERM)

        async def not_ready() -> bool:
            return await status(health, "readiness") == NOT_SERVING

        await until(not_ready, "readiness NOT_SERVING while draining", 4)
        assert await status(health, EXTPROC_SERVICE) == NOT_SERVING
        stream.cancel()


async def open_streams(picker: Picker, count: int) -> bool:
    async with (
        aiohttp.ClientSession() as session,
        session.get(picker.metrics + "/ready?verbose") as response,
    ):
        return bool((await response.json())["active_streams"] == count)


@pytest.mark.parametrize("gated", [True, False], ids=["endpoint_picker", "serve"])
async def test_readiness_waits_for_ready_and_only_the_picker_gates_the_extproc_service(
    gated: bool,
) -> None:
    services = HealthServices(gated)
    server = health_server(services)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await services.started()
            assert await status(channel, "liveness") == SERVING
            assert await status(channel, "readiness") == NOT_SERVING
            assert await status(channel, EXTPROC_SERVICE) == (NOT_SERVING if gated else SERVING)
            await services.ready()
            for service in PROTOCOL_SERVICES:
                assert await status(channel, service) == SERVING, service
    finally:
        await server.stop(None)


async def test_the_configured_certificate_is_served_when_given(tmp_path: Path) -> None:
    ca = trustme.CA()
    server = ca.issue_cert("epp.example")
    files = {
        "ca_file": tmp_path / "ca.pem",
        "cert_file": tmp_path / "server.pem",
        "key_file": tmp_path / "server.key",
    }
    ca.cert_pem.write_to_path(files["ca_file"])
    server.cert_chain_pems[0].write_to_path(files["cert_file"])
    server.private_key_pem.write_to_path(files["key_file"])
    tls = {name: str(path) for name, path in files.items()}
    async with (
        running_engine("--kv-transfer-config", PUSH[0]) as prefill,
        running_engine("--kv-transfer-config", PUSH[1]) as decode,
        running_epp(
            epp_config([address(prefill)], [address(decode)], extproc={"tls": tls})
        ) as picker,
    ):
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        options = (("grpc.ssl_target_name_override", "epp.example"),)
        async with aio.secure_channel(picker.extproc, credentials, options) as channel:
            assert await status(channel, "readiness") == SERVING


async def test_the_picker_port_serves_neither_eds_nor_the_access_log(picker: Picker) -> None:
    """A gateway calls the ext_proc only: whoever reaches the port may not read the pools'
    members or write access-log entries (which would count outcomes and grow /metrics)."""
    async with tls_channel(picker.extproc) as channel:
        assert await status(channel, "readiness") == SERVING  # the port answers
        for call in (pool_members(channel, "decode_pool"), send_access_log(channel)):
            with pytest.raises(aio.AioRpcError) as refused:
                await call
            assert refused.value.code() in REFUSED


def _pem_files(tmp_path: Path, ca: trustme.CA, name: str, stem: str) -> tuple[str, str]:
    issued = ca.issue_cert(name)
    cert, key = tmp_path / f"{stem}.pem", tmp_path / f"{stem}.key"
    issued.cert_chain_pems[0].write_to_path(cert)
    issued.private_key_pem.write_to_path(key)
    return str(cert), str(key)


@pytest.mark.parametrize("server_cert", ["configured", "self_signed"])
async def test_a_client_ca_lets_only_the_gateways_it_signed_in(
    tmp_path: Path, server_cert: str
) -> None:
    server_ca, gateway_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    gateway_ca.cert_pem.write_to_path(tmp_path / "gateway-ca.pem")
    extproc: dict[str, object] = {}
    if server_cert == "configured":
        server_ca.cert_pem.write_to_path(tmp_path / "server-ca.pem")
        cert, key = _pem_files(tmp_path, server_ca, "epp.example", "server")
        tls = {"cert_file": cert, "key_file": key, "ca_file": str(tmp_path / "server-ca.pem")}
        extproc["tls"] = tls
    picker_settings = {"client_ca_file": str(tmp_path / "gateway-ca.pem")}
    async with (
        running_engine("--kv-transfer-config", PUSH[0]) as prefill,
        running_engine("--kv-transfer-config", PUSH[1]) as decode,
        running_epp(
            epp_config(
                [address(prefill)],
                [address(decode)],
                extproc=extproc,
                endpoint_picker=picker_settings,
            )
        ) as picker,
    ):
        if server_cert == "configured":
            trusted = server_ca.cert_pem.bytes()
        else:  # the gateways do not check a self-signed one: take what it presents
            host, _, port = picker.extproc.rpartition(":")
            trusted = await asyncio.to_thread(ssl.get_server_certificate, (host, int(port)))
            trusted = trusted.encode()
        name = "epp.example" if server_cert == "configured" else "localhost"
        options = (("grpc.ssl_target_name_override", name),)

        async def check(client: trustme.CA | None) -> int:
            issued = None if client is None else client.issue_cert("gateway")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=trusted,
                private_key=None if issued is None else issued.private_key_pem.bytes(),
                certificate_chain=None if issued is None else issued.cert_chain_pems[0].bytes(),
            )
            async with aio.secure_channel(picker.extproc, credentials, options) as channel:
                return await status(channel, "readiness")

        for stranger in (None, stranger_ca):  # no certificate, or one another CA signed
            with pytest.raises(aio.AioRpcError) as refused:
                await check(stranger)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await check(gateway_ca) == SERVING
        assert ANY_CLIENT not in picker.log_path.read_text()
