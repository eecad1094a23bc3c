"""Who reaches the ext_proc's gRPC services (ext_proc, the pools' EDS, the access log): with
`up`, only the Envoy it starts. They listen on a Unix socket in the run directory (mode 0700),
never on a TCP port, so no other process or host can fetch the pools' members, write fake
access-log entries or fire a P leg with a raw ext_proc call."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.engines import MODEL
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
