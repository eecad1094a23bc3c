"""Who reaches the ext_proc's gRPC services (ext_proc, the pools' EDS, the access log): with
`up`, only the Envoy it starts. They listen on a Unix socket in the run directory (mode 0700),
never on a TCP port, so no other process or host can fetch the pools' members, write fake
access-log entries or fire a P leg with a raw ext_proc call. With `serve`, EDS and the access
log may have a listener of their own (extproc.eds_access_log), off the ext_proc's port."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.testing import scrape
from tests.support.engines import MODEL
from tests.support.envoy_feeds import REFUSED, pool_members, send_access_log
from tests.support.polling import until
from tests.support.split import split_topology
from tests.support.topology import topology

COMPLETION = {"model": MODEL, "prompt": "who calls " * 5, "max_tokens": 2}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _listens(port: int) -> bool:
    with socket.socket() as client:
        client.settimeout(1)
        return client.connect_ex(("127.0.0.1", port)) == 0


async def test_up_serves_its_grpc_only_on_a_private_unix_socket() -> None:
    port = _free_port()  # what extproc.port asks for: nothing may listen there
    async with topology(extproc={"port": port}) as topo:
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        address = topo.sidecar.extproc
        assert address.startswith("unix:"), address
        directory = Path(address.removeprefix("unix:")).parent
        mode = directory.stat()
        assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()
        assert not _listens(port), f"something listens on extproc.port {port}"
        # the socket itself answers (Envoy's health check goes there): its owner may call it
        async with grpc.aio.insecure_channel(address) as channel:
            service = "envoy.service.ext_proc.v3.ExternalProcessor"
            check = health_pb2_grpc.HealthStub(channel).Check
            answer = await check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_serve_can_keep_eds_and_the_access_log_off_the_extproc_port() -> None:
    extproc_port, side_port = _free_port(), _free_port()
    extproc = {
        "host": "127.0.0.1",
        "port": extproc_port,
        "eds_access_log": {"host": "127.0.0.1", "port": side_port},
    }
    async with split_topology(extproc=extproc) as split:
        status, _ = await _post(split.url)
        assert status == 200
        # the Envoy rendered for this config takes the members and sends its log there
        async with aiohttp.ClientSession() as session:

            async def logged() -> bool:
                samples = await scrape(session, split.metrics + "/metrics")
                key = 'pd_extproc_access_log_entries_total{result="observed"}'
                return samples.get(key, 0) >= 1 and samples["pd_extproc_eds_streams"] >= 1

            await until(logged, "Envoy's EDS stream and access-log entry on their listener")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{side_port}") as side:
            assert await pool_members(side, "decode_pool") == split.cfg.decode.addresses
        async with grpc.aio.insecure_channel(f"127.0.0.1:{extproc_port}") as channel:
            for call in (pool_members(channel, "decode_pool"), send_access_log(channel)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() in REFUSED


async def _post(url: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=COMPLETION) as response,
    ):
        return response.status, await response.read()
