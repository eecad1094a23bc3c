"""The sidecar's Kubernetes probes: `/ready` means "this process answers Envoy", not "an
engine is healthy", so that a gateway whose engines are down stays in its Service and its
clients get a JSON 503 instead of a refused connection; `/live` is liveness alone."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
import orjson

from extproc.testing import ephemeral_config, running_sidecar
from tests.support.engines import MODEL, address
from vllmsim.launcher import PUSH_P, running_engine

TIMEOUT = aiohttp.ClientTimeout(total=5)


def closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with session.get(url, timeout=TIMEOUT) as response:
        return response.status, orjson.loads(await response.read())


async def test_ready_without_a_healthy_decode_and_the_client_gets_a_json_503() -> None:
    dead = f"127.0.0.1:{closed_port()}"
    async with running_engine("--kv-transfer-config", PUSH_P) as p:
        config = ephemeral_config([address(p)], [dead])
        async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 10
            while True:  # the health checks mark the dead decode down after two failures
                status, state = await get(session, sidecar.metrics + "/ready?verbose")
                if not state["decode"][dead]["healthy"]:
                    break
                assert time.monotonic() < deadline, f"the dead decode stayed healthy: {state}"
                await asyncio.sleep(0.1)
            assert (status, state["ready"], state["engines_ready"]) == (200, True, False)
            body = {"model": MODEL, "prompt": "anyone there?", "max_tokens": 2}
            async with session.post(
                sidecar.url + "/v1/completions", json=body, timeout=TIMEOUT
            ) as response:
                assert response.status == 503
                assert response.headers["content-type"] == "application/json"
                error = orjson.loads(await response.read())["error"]
            assert error["message"] == "no healthy decode endpoint; retry later"
            assert await get(session, sidecar.metrics + "/live") == (200, {"live": True})


async def test_ready_tells_anyone_ready_or_not_and_only_the_operator_the_detail() -> None:
    """The metrics port may be open to a cluster: /ready says whether and why in a few words,
    never an engine's address, load or identity; /ready?verbose has those when
    metrics.ready_detail is on, and is refused (403) otherwise."""
    dead = f"127.0.0.1:{closed_port()}"
    async with running_engine("--kv-transfer-config", PUSH_P) as p:
        for detail in (False, True):
            config = ephemeral_config([address(p)], [dead], metrics={"ready_detail": detail})
            async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:
                async with session.get(sidecar.metrics + "/ready", timeout=TIMEOUT) as response:
                    body = await response.read()
                state = orjson.loads(body)
                assert set(state) == {"ready", "reason", "engines_ready"}, state
                assert state["ready"] and response.status == 200
                for engine in (address(p), dead, str(p.port), "127.0.0.1"):
                    assert engine.encode() not in body, body
                status, verbose = await get(session, sidecar.metrics + "/ready?verbose")
                if detail:
                    assert status == 200 and dead in verbose["decode"], verbose
                else:
                    assert status == 403 and "metrics.ready_detail" in verbose["error"]
