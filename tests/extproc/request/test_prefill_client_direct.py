"""The P leg straight to the engine, against a local aiohttp server standing in for vLLM:
what P receives (no routing header; the engines' key unless the client's is forwarded), one
kept-alive connection per engine, and how failures become the client's status."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from extproc.config import DecisionConfig
from extproc.errors import PrefillFailed, PrefillTimeout, PrefillUnreachable
from extproc.request.prefill_client import (
    PrefillCall,
    PrefillClient,
    PrefillPaths,
    ThroughListener,
    ToEngine,
    TrackedPrefillSender,
)
from extproc.scheduling.pool import EndpointState

PARAMS = {"remote_engine_id": "e1", "remote_host": "10.0.0.1", "remote_port": 5600}
KEY = {"authorization": "Bearer engine-key"}


class FakeEngine:
    def __init__(self) -> None:
        self.received: list[tuple[web.Request, bytes]] = []
        self.peers: list[int] = []  # the client port of each request's connection
        self.status = 200
        self.hold = asyncio.Event()
        self.hold.set()
        self.arrived = asyncio.Event()  # a request came in
        self.address = ""

    async def dispatch(self, request: web.Request) -> web.Response:
        self.received.append((request, await request.read()))
        self.arrived.set()
        self.peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        await self.hold.wait()
        if self.status != 200:
            return web.json_response({"error": {"message": "nope"}}, status=self.status)
        return web.json_response({"id": "cmpl-1", "kv_transfer_params": PARAMS})


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.dispatch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.address = f"127.0.0.1:{runner.addresses[0][1]}"
    yield fake
    fake.hold.set()
    await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[PrefillClient]:
    direct = PrefillClient(ToEngine(connect_timeout_s=2, auth_headers=lambda: dict(KEY)))
    yield direct
    await direct.close()


async def test_p_gets_the_body_the_request_id_and_the_engines_key(
    engine: FakeEngine, client: PrefillClient
) -> None:
    result = await client.send(
        PrefillCall(
            engine.address,
            "/v1/completions",
            b'{"prompt":"p"}',
            "rid-1",
            5,
            headers={"traceparent": "00-abc-def-01"},
        )
    )
    assert result.kv_transfer_params == PARAMS and result.status == 200
    [(request, body)] = engine.received
    assert (request.method, request.path, body) == ("POST", "/v1/completions", b'{"prompt":"p"}')
    assert request.headers["x-request-id"] == "rid-1"
    assert request.headers["traceparent"] == "00-abc-def-01"
    assert request.headers["authorization"] == KEY["authorization"]
    assert request.headers["content-type"] == "application/json"
    assert "x-gateway-destination-endpoint" not in request.headers


async def test_a_forwarded_client_key_wins_over_the_engines_key(
    engine: FakeEngine, client: PrefillClient
) -> None:
    await client.send(
        PrefillCall(
            engine.address,
            "/v1/completions",
            b"{}",
            "rid",
            5,
            headers={"authorization": "Bearer client"},
        )
    )
    assert engine.received[0][0].headers["authorization"] == "Bearer client"


async def test_requests_to_one_engine_share_a_kept_alive_connection(
    engine: FakeEngine, client: PrefillClient
) -> None:
    for n in range(3):
        await client.send(PrefillCall(engine.address, "/v1/completions", b"{}", f"rid-{n}", 5))
    assert len(set(engine.peers)) == 1, engine.peers


async def test_an_unreachable_engine_is_503_with_retry_after(client: PrefillClient) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(PrefillUnreachable) as caught:
        await client.send(PrefillCall(address, "/v1/completions", b"{}", "rid", 5))
    assert (caught.value.status, caught.value.retry_after_s) == (503, 1)
    assert address not in caught.value.message and address in str(caught.value.detail)


@pytest.mark.parametrize(("answered", "status"), [(500, 502), (400, 400)])
async def test_p_errors_become_the_clients_status(
    engine: FakeEngine, client: PrefillClient, answered: int, status: int
) -> None:
    engine.status = answered
    with pytest.raises(PrefillFailed) as caught:
        await client.send(PrefillCall(engine.address, "/v1/completions", b"{}", "rid", 5))
    assert caught.value.status == status and "nope" in caught.value.message


async def test_a_silent_engine_is_a_504_within_the_timeout(
    engine: FakeEngine, client: PrefillClient
) -> None:
    engine.hold.clear()
    with pytest.raises(PrefillTimeout) as caught:
        leg = PrefillCall(engine.address, "/v1/completions", b"{}", "rid", 0.2)
        await asyncio.wait_for(client.send(leg), 2)
    assert caught.value.status == 504


async def test_the_path_is_chosen_per_request(engine: FakeEngine) -> None:
    path = ["direct"]
    # would fail: no listener
    listener = PrefillClient(ThroughListener("127.0.0.1:1", connect_timeout_s=0.5))
    direct = PrefillClient(ToEngine(connect_timeout_s=2, auth_headers=dict))
    paths = PrefillPaths(listener, direct, lambda: path[0])
    try:
        result = await paths.send(PrefillCall(engine.address, "/v1/completions", b"{}", "rid", 5))
        assert result.kv_transfer_params == PARAMS
        path[0] = "listener"
        with pytest.raises(Exception, match="prefill listener"):
            await paths.send(PrefillCall(engine.address, "/v1/completions", b"{}", "rid", 5))
    finally:
        await paths.close()


@pytest.mark.parametrize("status", [200, 500])
async def test_a_tracked_leg_counts_its_prompt_tokens_at_p_only_while_it_runs(
    engine: FakeEngine, client: PrefillClient, status: int
) -> None:
    state = EndpointState(engine.address)
    tracked = TrackedPrefillSender(
        client, {engine.address: state}.get, lambda: DecisionConfig(bytes_per_token=4)
    )
    engine.hold.clear()
    engine.status = status
    leg = asyncio.create_task(
        tracked.send(PrefillCall(engine.address, "/v1/completions", b"x" * 41, "rid", 5))
    )
    await asyncio.wait_for(engine.arrived.wait(), 5)
    assert state.queued_tokens == 11  # ceil(41 / 4)
    engine.hold.set()
    with contextlib.suppress(PrefillFailed):
        await asyncio.wait_for(leg, 5)
    assert state.queued_tokens == 0
