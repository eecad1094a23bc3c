"""The P leg's HTTP client against a local aiohttp server standing in for Envoy's listener.

What is checked is what the processor relies on: the request P receives, and how each kind of
answer (or silence) becomes a PrefillResult or the LegError with the status the client gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from extproc.config import parse_config
from extproc.errors import ListenerUnreachable, PrefillFailed, PrefillTimeout, PrefillUnreachable
from extproc.headers import LOCAL_REPLY_HEADER
from extproc.request.prefill_client import PrefillCall, PrefillClient, ThroughListener

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# the legs' config snapshot: nothing in it changes a leg through the listener
CONFIG = parse_config(
    {"prefill": {"endpoints": ["10.0.0.7:8100"]}, "decode": {"endpoints": ["10.0.0.8:8200"]}}
)
PARAMS = {"remote_engine_id": "e1", "remote_host": "10.0.0.1", "remote_port": 5600}


class FakeListener:
    """Envoy's prefill listener: answers with `handler`, records what it received."""

    def __init__(self) -> None:
        self.handler: Handler = self._ok
        self.received: list[tuple[web.Request, bytes]] = []
        self.peers: list[int] = []  # the client port of each request's connection
        self.address = ""

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"id": "cmpl-1", "kv_transfer_params": PARAMS})

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        self.received.append((request, await request.read()))
        self.peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return await self.handler(request)


@pytest.fixture
async def listener() -> AsyncIterator[FakeListener]:
    fake = FakeListener()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.dispatch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.address = f"127.0.0.1:{runner.addresses[0][1]}"
    yield fake
    await runner.cleanup()


@pytest.fixture
async def client(listener: FakeListener) -> AsyncIterator[PrefillClient]:
    prefill = PrefillClient(ThroughListener(listener.address, connect_timeout_s=2))
    yield prefill
    await prefill.close()


def answer(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, headers=headers)

    return handler


async def test_p_receives_the_body_and_the_routing_headers(
    listener: FakeListener, client: PrefillClient
) -> None:
    result = await client.send(
        PrefillCall(
            "10.0.0.7:8100",
            "/v1/completions",
            b'{"prompt":"p"}',
            "rid-1",
            5,
            CONFIG,
            headers={"traceparent": "00-abc-def-01"},
        )
    )
    [(request, body)] = listener.received
    assert (request.method, request.path, body) == ("POST", "/v1/completions", b'{"prompt":"p"}')
    assert request.headers["x-gateway-destination-endpoint"] == "10.0.0.7:8100"
    assert request.headers["x-request-id"] == "rid-1"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["traceparent"] == "00-abc-def-01"
    assert result.status == 200
    assert result.kv_transfer_params == PARAMS


async def test_result_times_the_leg(listener: FakeListener, client: PrefillClient) -> None:
    reached, release = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        reached.set()
        await release.wait()
        return web.json_response({"kv_transfer_params": PARAMS})

    listener.handler = slow
    before = time.perf_counter()
    sending = asyncio.create_task(
        client.send(PrefillCall("p", "/v1/completions", b"{}", "r", 5, CONFIG))
    )
    await asyncio.wait_for(reached.wait(), 5)
    asyncio.get_running_loop().call_later(0.05, release.set)  # P takes at least 50 ms
    result = await sending
    after = time.perf_counter()
    assert before <= result.started_at <= after - result.elapsed_s
    assert 0.05 <= result.elapsed_s <= after - before


async def test_answer_without_params_gives_none(
    listener: FakeListener, client: PrefillClient
) -> None:
    listener.handler = answer(200, b'{"id":"cmpl-1"}')
    result = await client.send(PrefillCall("p", "/v1/completions", b"{}", "r", 5, CONFIG))
    assert result.kv_transfer_params is None


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b""])
async def test_a_2xx_that_is_not_a_json_object_is_a_502(
    listener: FakeListener, client: PrefillClient, body: bytes
) -> None:
    listener.handler = answer(200, body)
    with pytest.raises(PrefillFailed) as caught:
        await client.send(PrefillCall("10.0.0.7:8100", "/v1/completions", b"{}", "r", 5, CONFIG))
    assert caught.value.status == 502
    assert caught.value.message == "the prefill engine sent a non-JSON body"


@pytest.mark.parametrize(
    ("p_status", "client_status"),
    [(300, 502), (400, 400), (404, 404), (499, 499), (500, 502), (503, 502)],
)
async def test_p_errors_map_to_the_clients_status(
    listener: FakeListener, client: PrefillClient, p_status: int, client_status: int
) -> None:
    """4xx is the request's fault and is passed on; anything else from P is a bad gateway."""
    listener.handler = answer(p_status, b"oops")
    with pytest.raises(PrefillFailed) as caught:
        await client.send(PrefillCall("10.0.0.7:8100", "/v1/completions", b"{}", "r", 5, CONFIG))
    assert caught.value.status == client_status
    assert caught.value.message == f"the prefill engine answered {p_status}"
    assert caught.value.detail == "prefill 10.0.0.7:8100"  # the log's, never the client's
    assert caught.value.retry_after_s is None


async def test_ps_own_error_message_is_passed_on(
    listener: FakeListener, client: PrefillClient
) -> None:
    error = {"error": {"message": "max_tokens is too large", "type": "BadRequestError"}}
    listener.handler = answer(400, orjson.dumps(error))
    with pytest.raises(PrefillFailed) as caught:
        await client.send(PrefillCall("10.0.0.7:8100", "/v1/completions", b"{}", "r", 5, CONFIG))
    assert caught.value.message == "the prefill engine answered 400: max_tokens is too large"


async def test_a_flat_error_string_is_passed_on(
    listener: FakeListener, client: PrefillClient
) -> None:
    """vLLM's own 401 answers {"error": "Unauthorized"}: the string is the message."""
    listener.handler = answer(401, b'{"error": "Unauthorized"}')
    with pytest.raises(PrefillFailed) as caught:
        await client.send(PrefillCall("p1", "/v1/completions", b"{}", "r", 5, CONFIG))
    assert (caught.value.status, caught.value.message) == (
        401,
        "the prefill engine answered 401: Unauthorized",
    )


@pytest.mark.parametrize(
    "body", [b'{"error": {"type": "x"}}', b'{"error": 3}', b'{"detail": "x"}', b'["x"]']
)
async def test_error_bodies_of_other_shapes_are_not_quoted(
    listener: FakeListener, client: PrefillClient, body: bytes
) -> None:
    listener.handler = answer(500, body)
    with pytest.raises(PrefillFailed) as caught:
        await client.send(PrefillCall("p1", "/v1/completions", b"{}", "r", 5, CONFIG))
    assert caught.value.message == "the prefill engine answered 500"


@pytest.mark.parametrize("flags", ["UF", "UH", "URX", "UO", "UC", "UR", "NR", "LR", "DC,UF"])
async def test_envoys_own_connect_failure_is_unreachable(
    listener: FakeListener, client: PrefillClient, flags: str
) -> None:
    listener.handler = answer(503, b"no healthy upstream", {LOCAL_REPLY_HEADER: flags})
    with pytest.raises(PrefillUnreachable) as caught:
        await client.send(PrefillCall("10.0.0.7:8100", "/v1/completions", b"{}", "r", 5, CONFIG))
    assert (caught.value.status, caught.value.retry_after_s) == (503, 1)
    assert caught.value.message == f"the prefill engine is unreachable ({flags}); retry"


@pytest.mark.parametrize("flags", ["DC", "UT", "-", ""])
async def test_other_envoy_flags_are_ps_answer(
    listener: FakeListener, client: PrefillClient, flags: str
) -> None:
    """Only flags that mean "never reached" or "connection dropped" make P unreachable."""
    listener.handler = answer(503, b"", {LOCAL_REPLY_HEADER: flags})
    with pytest.raises(PrefillFailed) as caught:
        await client.send(PrefillCall("p1", "/v1/completions", b"{}", "r", 5, CONFIG))
    assert not isinstance(caught.value, PrefillUnreachable)
    assert caught.value.status == 502


async def test_silent_p_times_out_with_504(listener: FakeListener, client: PrefillClient) -> None:
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response()

    listener.handler = hang
    with pytest.raises(PrefillTimeout) as caught:
        await client.send(PrefillCall("10.0.0.7:8100", "/v1/completions", b"{}", "r", 0.2, CONFIG))
    release.set()
    assert caught.value.status == 504
    assert caught.value.message == "the prefill engine did not answer within 0.2 s"
    assert caught.value.detail == "prefill 10.0.0.7:8100"


async def test_legs_in_flight_are_not_queued_behind_each_other(
    listener: FakeListener, client: PrefillClient
) -> None:
    """No connection limit: a long prefill does not hold back the next request's P leg."""
    arrived = 0
    all_arrived = asyncio.Event()

    async def wait_for_all(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        if arrived == 120:
            all_arrived.set()
        await all_arrived.wait()
        return web.json_response({"kv_transfer_params": PARAMS})

    listener.handler = wait_for_all
    results = await asyncio.gather(
        *(
            client.send(PrefillCall("p", "/v1/completions", b"{}", f"r{i}", 5, CONFIG))
            for i in range(120)
        )
    )
    assert [r.status for r in results] == [200] * 120


async def test_unreachable_listener_is_a_retryable_503() -> None:
    """Not P's fault: ListenerUnreachable, which leaves P's health alone."""
    prefill = PrefillClient(ThroughListener("127.0.0.1:1", connect_timeout_s=2))
    try:
        with pytest.raises(ListenerUnreachable) as caught:
            await prefill.send(PrefillCall("p", "/v1/completions", b"{}", "r", 5, CONFIG))
    finally:
        await prefill.close()
    assert (caught.value.status, caught.value.retry_after_s) == (503, 1)
    assert caught.value.message == "the prefill listener is unreachable (connection refused); retry"
    assert "127.0.0.1" in str(caught.value.detail)  # asyncio's text names the address: log only


async def test_unix_socket_listener(tmp_path: Path) -> None:
    received: list[tuple[str, str]] = []

    async def handler(request: web.Request) -> web.Response:
        received.append((request.host, request.path))
        return web.json_response({"kv_transfer_params": PARAMS})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    path = tmp_path / "prefill.sock"
    await web.UnixSite(runner, str(path)).start()
    prefill = PrefillClient(ThroughListener(f"unix:{path}", connect_timeout_s=2))
    try:
        result = await prefill.send(PrefillCall("p", "/v1/chat/completions", b"{}", "r", 5, CONFIG))
    finally:
        await prefill.close()
        await runner.cleanup()
    assert result.kv_transfer_params == PARAMS
    assert received == [("prefill", "/v1/chat/completions")]


async def test_close_then_send_opens_new_connections(
    listener: FakeListener, client: PrefillClient
) -> None:
    await client.send(PrefillCall("p", "/v1/completions", b"{}", "r1", 5, CONFIG))
    first = client.connections
    await client.close()
    await client.close()  # twice is harmless
    result = await client.send(PrefillCall("p", "/v1/completions", b"{}", "r2", 5, CONFIG))
    assert result.status == 200 and client.connections is not first
    assert len(set(listener.peers)) == 2  # the first connection was closed, not reused


async def test_connect_is_bounded_by_the_connect_timeout_not_the_leg_timeout() -> None:
    """A listener that never completes the handshake fails the leg after connect_timeout_s."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)  # never accepted: once the queue is full, further SYNs are dropped
        port = server.getsockname()[1]
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
        prefill = PrefillClient(ThroughListener(f"127.0.0.1:{port}", connect_timeout_s=0.3))
        started = time.perf_counter()
        try:
            with pytest.raises(ListenerUnreachable) as caught:
                await prefill.send(PrefillCall("p", "/v1/completions", b"{}", "r", 10, CONFIG))
        finally:
            await prefill.close()
            for filler in fillers:
                filler.close()
    assert time.perf_counter() - started < 3  # not the leg's 10 s
    assert (caught.value.status, caught.value.retry_after_s) == (503, 1)
    assert caught.value.message == (
        "the prefill listener did not accept a connection within 0.3 s; retry"
    )


async def test_a_header_with_a_line_break_is_the_clients_400_and_nothing_is_sent(
    listener: FakeListener, client: PrefillClient
) -> None:
    call = PrefillCall("p", "/v1/completions", b"{}", "r", 5, CONFIG, {"x-tag": "a\r\nb: c"})
    with pytest.raises(PrefillFailed) as caught:
        await client.send(call)
    assert caught.value.status == 400 and "line break" in caught.value.message
    assert listener.received == []
