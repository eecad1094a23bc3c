"""The P leg straight to the engine, against a local aiohttp server standing in for vLLM:
what P receives (no routing header; the engines' key unless the client's is forwarded), one
kept-alive connection per engine, and how failures become the client's status."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from grpc import aio

from extproc.config import Config
from extproc.errors import PrefillFailed, PrefillTimeout, PrefillUnreachable
from extproc.request.prefill_client import (
    PrefillCall,
    PrefillClient,
    PrefillPaths,
    ThroughListener,
    ToEngine,
    TrackedPrefillSender,
    p_leg_key,
)
from extproc.roles import Role
from extproc.scheduling.pool import EndpointState
from extproc.scheduling.shared_load import SharedLoad, table_bytes
from extproc.wiring import Runtime
from tests.support.routing import fixed_routing_config
from tests.support.scripted_envoy import D1, REQUEST, WAIT_S, ScriptedEnvoy, body, headers
from tests.support.scripted_prefill import run

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


def settings(
    tmp_path: Path,
    forward: list[str] | None = None,
    prefill_leg: str = "direct",
    bytes_per_token: float = 4,
    key: str = "engine-key",
    prefill: str = "127.0.0.1:8100",
) -> Config:
    """A config with the engines' `key` in engines.api_key_file; `forward`: forward_headers
    (by default without the client's key, so that a direct leg carries the engines')."""
    key_file = tmp_path / key
    key_file.write_text(f"{key}\n")
    return fixed_routing_config(
        {
            "prefill": {"endpoints": [prefill]},
            "decode": {"endpoints": [D1]},
            "engines": {"api_key_file": str(key_file)},
            "dispatch": {"forward_headers": forward or ["traceparent"], "prefill_leg": prefill_leg},
            "decision": {"bytes_per_token": bytes_per_token},
        }
    )


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return settings(tmp_path)


@pytest.fixture
async def client() -> AsyncIterator[PrefillClient]:
    direct = PrefillClient(ToEngine(connect_timeout_s=2))
    yield direct
    await direct.close()


@pytest.mark.parametrize(
    ("forward", "sent"),
    [(["authorization"], {}), (["traceparent"], KEY)],
    ids=["client key forwarded", "client key not forwarded"],
)
def test_a_direct_p_leg_carries_the_engines_key_only_without_the_clients(
    tmp_path: Path, forward: list[str], sent: dict[str, str]
) -> None:
    assert p_leg_key(settings(tmp_path, forward)) == sent


async def test_p_gets_the_body_the_request_id_and_the_engines_key(
    config: Config, engine: FakeEngine, client: PrefillClient
) -> None:
    result = await client.send(
        PrefillCall(
            engine.address,
            "/v1/completions",
            b'{"prompt":"p"}',
            "rid-1",
            5,
            config,
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
    config: Config, engine: FakeEngine, client: PrefillClient
) -> None:
    await client.send(
        PrefillCall(
            engine.address,
            "/v1/completions",
            b"{}",
            "rid",
            5,
            config,
            headers={"authorization": "Bearer client"},
        )
    )
    assert engine.received[0][0].headers["authorization"] == "Bearer client"


async def test_requests_to_one_engine_share_a_kept_alive_connection(
    config: Config, engine: FakeEngine, client: PrefillClient
) -> None:
    for n in range(3):
        await client.send(
            PrefillCall(engine.address, "/v1/completions", b"{}", f"rid-{n}", 5, config)
        )
    assert len(set(engine.peers)) == 1, engine.peers


async def test_an_unreachable_engine_is_503_with_retry_after(
    config: Config, client: PrefillClient
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(PrefillUnreachable) as caught:
        await client.send(PrefillCall(address, "/v1/completions", b"{}", "rid", 5, config))
    assert (caught.value.status, caught.value.retry_after_s) == (503, 1)
    assert address not in caught.value.message and address in str(caught.value.detail)


@pytest.mark.parametrize(("answered", "status"), [(500, 502), (400, 400)])
async def test_p_errors_become_the_clients_status(
    config: Config, engine: FakeEngine, client: PrefillClient, answered: int, status: int
) -> None:
    engine.status = answered
    with pytest.raises(PrefillFailed) as caught:
        await client.send(PrefillCall(engine.address, "/v1/completions", b"{}", "rid", 5, config))
    assert caught.value.status == status and "nope" in caught.value.message


async def test_a_silent_engine_is_a_504_within_the_timeout(
    config: Config, engine: FakeEngine, client: PrefillClient
) -> None:
    engine.hold.clear()
    with pytest.raises(PrefillTimeout) as caught:
        leg = PrefillCall(engine.address, "/v1/completions", b"{}", "rid", 0.2, config)
        await asyncio.wait_for(client.send(leg), 2)
    assert caught.value.status == 504


@pytest.mark.parametrize("no_listener", [False, True], ids=["prefill_leg", "no listener"])
async def test_the_route_is_the_one_the_legs_own_config_names(
    engine: FakeEngine, tmp_path: Path, no_listener: bool
) -> None:
    # would fail: no listener
    listener = PrefillClient(ThroughListener("127.0.0.1:1", connect_timeout_s=0.5))
    direct = PrefillClient(ToEngine(connect_timeout_s=2))
    paths = PrefillPaths(listener, direct, no_listener)
    through_listener = settings(tmp_path, prefill_leg="listener")
    try:
        leg = PrefillCall(engine.address, "/v1/completions", b"{}", "rid", 5, settings(tmp_path))
        assert (await paths.send(leg)).kv_transfer_params == PARAMS
        leg = PrefillCall(engine.address, "/v1/completions", b"{}", "rid", 5, through_listener)
        if no_listener:  # an endpoint picker's legs go to the engine whatever prefill_leg says
            assert (await paths.send(leg)).kv_transfer_params == PARAMS
        else:
            with pytest.raises(Exception, match="prefill listener"):
                await paths.send(leg)
    finally:
        await paths.close()


@pytest.mark.parametrize("status", [200, 500])
async def test_a_tracked_leg_counts_its_prompt_tokens_at_p_only_while_it_runs(
    engine: FakeEngine, client: PrefillClient, tmp_path: Path, status: int
) -> None:
    table = bytearray(table_bytes(2))  # with another ext_proc process, which reads them too
    mine, other = (SharedLoad(table, 2, row, time.monotonic) for row in (0, 1))
    state = EndpointState(engine.address, role=Role.PREFILL, shared=mine)
    tracked = TrackedPrefillSender(client, {engine.address: state}.get)
    config = settings(tmp_path, bytes_per_token=4)
    engine.hold.clear()
    engine.status = status
    leg = asyncio.create_task(
        tracked.send(PrefillCall(engine.address, "/v1/completions", b"x" * 41, "rid", 5, config))
    )
    await asyncio.wait_for(engine.arrived.wait(), 5)
    assert state.queued_tokens == 11  # ceil(41 / 4)
    assert other.peers(Role.PREFILL, engine.address).queued_tokens == 11
    engine.hold.set()
    with contextlib.suppress(PrefillFailed):
        await asyncio.wait_for(leg, 5)
    assert state.queued_tokens == 0
    assert other.peers(Role.PREFILL, engine.address).queued_tokens == 0


async def test_a_reload_leaves_the_p_leg_of_a_request_in_flight_as_it_began(
    engine: FakeEngine, tmp_path: Path
) -> None:
    """The leg's route, the engines' key and its token estimate come from the request's
    config, taken when its stream opened, whatever a reload says meanwhile."""
    config = settings(tmp_path, prefill_leg="direct", bytes_per_token=4, prefill=engine.address)
    rt = Runtime(config, "unix:/nonexistent")  # no listener: a leg sent there fails
    envoy = ScriptedEnvoy()
    task = await run(rt, envoy)
    await envoy.inbox.put(headers(authorization=KEY["authorization"]))  # the client's key
    await envoy.until_sent(1)  # the stream is open: the request has its config
    new_key = "reloaded-key"
    rt.reload(settings(tmp_path, None, "listener", 1, new_key, engine.address))
    engine.hold.clear()
    await envoy.inbox.put(body(REQUEST))  # no identity cached: a serial P leg
    sent = asyncio.ensure_future(engine.arrived.wait())
    await asyncio.wait({sent, task}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    assert sent.done(), f"the P leg never reached the engine: {envoy.kinds()}"
    [(request, p_body)] = engine.received
    assert request.headers["authorization"] == KEY["authorization"]  # not the reloaded key
    [state] = rt.prefill
    assert state.queued_tokens == math.ceil(len(p_body) / 4)  # at 4 bytes a token, not 1
    engine.hold.set()
    await envoy.until_sent(3)  # D's body, after P's answer
    await envoy.inbox.put(aio.EOF)
    await asyncio.wait_for(task, WAIT_S)
    assert state.queued_tokens == 0
    await rt.prefill_client.close()
