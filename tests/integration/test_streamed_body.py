"""The LLM routes' streamed request body (FULL_DUPLEX_STREAMED) through a real Envoy: the
limits the ext_proc owns there (413, a stalled upload's 408), a client gone mid-upload, and
the catch-all route that stays buffered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest_asyncio

from extproc.testing import scrape
from tests.support.engines import MODEL
from tests.support.polling import until
from tests.support.topology import Topology, requests_total, topology
from vllmsim.launcher import FAST

LIMIT = 4096
IDLE_S = 0.5
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox " * 20, "max_tokens": 4}


@pytest_asyncio.fixture(scope="module")
async def small_limits() -> AsyncIterator[Topology]:
    async with topology(
        limits={"max_body_bytes": LIMIT}, timeouts={"upload_idle_s": IDLE_S}
    ) as topo:
        yield topo


async def partial_upload(
    topo: Topology, declared: int, sent: bytes, path: str = "/v1/completions"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An HTTP/1.1 POST declaring `declared` body bytes of which only `sent` go out."""
    url = urlsplit(topo.sidecar.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: llm\r\ncontent-type: application/json\r\n"
        f"content-length: {declared}\r\n\r\n"
    )
    writer.write(head.encode() + sent)
    await writer.drain()
    return reader, writer


async def response(
    reader: asyncio.StreamReader, timeout_s: float
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 response with a content-length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines if line)
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout_s)
    return int(status_line.split()[1]), headers, body


async def no_engine_saw_a_request(topo: Topology) -> None:
    for engine in topo.engines:
        assert await topo.seen(engine) == []


async def test_a_stalled_upload_gets_408_from_the_ext_proc(small_limits: Topology) -> None:
    topo = small_limits
    await topo.clear()
    reader, writer = await partial_upload(topo, 1000, b'{"model": "')
    try:
        status, headers, body = await response(reader, IDLE_S + 5)
    finally:
        writer.close()
    assert status == 408, body
    assert headers["content-type"] == "application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == 408 and "stalled" in error["message"]
    await no_engine_saw_a_request(topo)


async def test_a_body_over_the_limit_gets_413_before_the_upload_ends(
    small_limits: Topology,
) -> None:
    topo = small_limits
    await topo.clear()
    # Over the limit, and the rest never comes: only a check on the chunks as they arrive
    # answers 413 (else the upload would stall into a 408).
    reader, writer = await partial_upload(topo, 10 * LIMIT, b"x" * (LIMIT + 1))
    try:
        status, _, body = await response(reader, IDLE_S / 2)
    finally:
        writer.close()
    assert status == 413, body
    error = orjson.loads(body)["error"]
    assert error["code"] == 413 and str(LIMIT) in error["message"]
    await no_engine_saw_a_request(topo)


async def test_a_client_gone_mid_upload_leaves_nothing_behind(small_limits: Topology) -> None:
    topo = small_limits
    await topo.clear()
    before = await topo.metrics()
    _, writer = await partial_upload(topo, 1000, b'{"model": "')

    async def stream_open() -> bool:
        return bool((await topo.ready())["active_streams"])

    await until(stream_open, "the ext_proc stream of the upload")
    writer.close()

    async def stream_closed() -> bool:
        return not (await topo.ready())["active_streams"]

    await until(stream_closed, "the upload's ext_proc stream to close")
    after = await topo.metrics()
    gone = requests_total("cancelled", "none", "none", model="none")  # not a 408 ("client_error")
    assert after.get(gone, 0) == before.get(gone, 0) + 1
    await no_engine_saw_a_request(topo)
    status, body, _ = await topo.post("/v1/completions", COMPLETION)  # still serving
    assert status == 200, body


BODY_BYTES = "pd_extproc_request_body_bytes"


async def body_bytes(topo: Topology) -> float:
    """The bodies the ext_proc holds now (its budget's count), open streams or not."""
    return (await scrape(topo.session, topo.sidecar.metrics + "/metrics"))[BODY_BYTES]


async def test_held_uploads_beyond_the_budget_get_503_and_give_it_back() -> None:
    kib = 1024
    limits = {"max_body_bytes": 64 * kib, "max_body_bytes_in_flight": 256 * kib}
    async with topology(limits=limits) as topo:
        held = [await partial_upload(topo, 64 * kib, b"x" * (60 * kib)) for _ in range(4)]

        async def all_held() -> bool:
            return await body_bytes(topo) == 4 * 60 * kib

        await until(all_held, "the four held uploads' bytes")
        over, writer = await partial_upload(topo, 64 * kib, b"x" * (30 * kib))
        try:
            status, headers, body = await response(over, 5)  # at once, the upload unfinished
        finally:
            writer.close()
        assert status == 503, body
        assert headers["retry-after"] == "1"
        error = orjson.loads(body)["error"]
        assert error["code"] == 503 and "request bodies" in error["message"]
        status, body, _ = await topo.post("/v1/completions", COMPLETION)  # fits the room left
        assert status == 200, body
        await until(all_held, "the refused and the served request's bytes given back")
        for _, held_writer in held:  # the clients leave mid-upload
            held_writer.close()

        async def released() -> bool:
            return await body_bytes(topo) == 0

        await until(released, "the held uploads' bytes given back")
        status, body, _ = await topo.post("/v1/completions", b'{"model": ')  # refused: 400
        assert status == 400, body
        metrics = await topo.metrics()
        assert metrics[BODY_BYTES] == 0
        assert metrics[requests_total("shed", "none", "none", model="none")] == 1


async def test_a_slow_drip_gets_408_at_the_upload_deadline() -> None:
    async with topology(timeouts={"upload_idle_s": 1.0, "upload_s": 2.0}) as topo:
        reader, writer = await partial_upload(topo, 1000, b"{")
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = asyncio.create_task(response(reader, 10))
        try:
            # A byte every 0.25 s, never idle for 1 s, until 0.5 s before the deadline: a byte
            # still unread when Envoy closes the connection would turn its answer into a reset.
            while loop.time() - started < 1.5:
                writer.write(b" ")
                await writer.drain()
                await asyncio.wait({answer}, timeout=0.25)
            status, _, body = await answer
        finally:
            writer.close()
        took = loop.time() - started
        assert status == 408, body
        assert "took longer than 2 s" in orjson.loads(body)["error"]["message"]
        assert 1.9 < took < 4.0, took
        await no_engine_saw_a_request(topo)
        assert (await topo.metrics())[BODY_BYTES] == 0


async def test_the_catch_all_route_still_refuses_in_json(small_limits: Topology) -> None:
    status, body, _ = await small_limits.post("/v1/embeddings", COMPLETION)
    assert status == 404, body
    assert orjson.loads(body)["error"]["code"] == 404


async def test_a_streaming_answer_counts_in_flight_until_its_last_event() -> None:
    # Envoy would close the ext_proc stream once the response headers are answered: the
    # request (and its engines' load) would look finished while D still generates.
    async with topology(engine_flags=("--step-base-ms", "40")) as topo:
        body = COMPLETION | {"stream": True, "max_tokens": 20}
        decode = f"127.0.0.1:{topo.decodes[0].port}"
        async with topo.session.post(topo.sidecar.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            await response.content.readline()  # the first event: D is generating
            ready = await topo.ready()
            assert ready["active_streams"] == 1
            assert ready["decode"][decode]["in_flight"] == 1
            await response.read()
        released = await topo.released()
        assert released["decode"][decode]["in_flight"] == 0


MIB = 1 << 20
BIG_LIMITS = {"max_body_bytes": 16 * MIB, "max_body_bytes_in_flight": 256 * MIB}


async def rss_mib(pid: int) -> float:
    status = await asyncio.to_thread(Path(f"/proc/{pid}/status").read_text)
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


UPLOADS, UPLOAD_MIB = 32, 14  # 448 MiB held
HELD = 1.15  # measured 1.01-1.05 (a growing buffer per upload: 1.31-1.39)


async def test_held_uploads_cost_the_ext_proc_what_they_hold() -> None:
    """Uploads sent a MiB at a time, in turns, then held: the ext_proc grows by what they hold
    (the issue's rule: at most 1.5 x plus a constant). Gathered in a buffer that grew in
    glibc's heap, each growth left a hole behind while the others grew."""
    limits = {"max_body_bytes": 16 * MIB, "max_body_bytes_in_flight": 512 * MIB}
    async with topology(limits=limits) as topo:
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        base = await rss_mib(topo.sidecar.pid)
        uploads = [await partial_upload(topo, 16 * MIB, b"") for _ in range(UPLOADS)]
        try:
            for sent in range(1, UPLOAD_MIB + 1):
                for _, writer in uploads:
                    writer.write(b"x" * MIB)
                    await writer.drain()

                async def all_read(held: int = UPLOADS * sent * MIB) -> bool:
                    return await body_bytes(topo) == held

                # each round read before the next: what is held, not what is in transit
                await until(all_read, f"{sent} MiB of each upload", timeout_s=30)
            held = UPLOADS * UPLOAD_MIB * MIB
            grown = await rss_mib(topo.sidecar.pid) - base
        finally:
            for _, writer in uploads:
                writer.close()
        assert grown <= HELD * held / MIB, (grown, held / MIB)


async def test_the_memory_of_big_bodies_goes_back_once_they_end() -> None:
    """Eight 10 MB prompts at once, whose copies the heap keeps warm for the next ones: once
    they are answered (and no big body follows), the ext_proc is back to its size before
    (measured: within 1 MiB; 40-50 MiB over it when gRPC's threads had heaps of their own,
    whose free tops glibc's trim leaves, as the 1 MiB mmap threshold did too)."""
    prompt = "w1" + " " * (10_000_000 - 4) + "w2"  # spaces: the engines skip them at once
    big = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
    async with topology(engine_flags=FAST, limits=BIG_LIMITS) as topo:
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        base = await rss_mib(topo.sidecar.pid)
        answers = await asyncio.gather(*(topo.post("/v1/completions", big) for _ in range(8)))
        assert [status for status, _, _ in answers] == [200] * 8
        answers.clear()

        async def given_back() -> bool:
            return await rss_mib(topo.sidecar.pid) <= base + 16

        await until(given_back, "the bodies' memory given back", timeout_s=20)
