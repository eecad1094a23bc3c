"""Operations: graceful drain on SIGTERM, configuration reload on SIGHUP."""

from __future__ import annotations

import asyncio
import os
import signal
from urllib.parse import urlsplit

import aiohttp
import pytest

from extproc.testing import scrape
from tests.support.engines import MODEL
from tests.support.polling import until
from tests.support.topology import topology

SLOW = ("--step-base-ms", "40")


async def refuses_connections(url: str) -> bool:
    parts = urlsplit(url)
    try:
        _, writer = await asyncio.open_connection(parts.hostname, parts.port)
    except ConnectionRefusedError:
        return True
    writer.close()
    await writer.wait_closed()
    return False


async def test_sigterm_drains_open_streams_and_refuses_new_requests() -> None:
    async with topology(engine_flags=SLOW, timeouts={"drain_s": 10}) as topo:
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 40, "stream": True}
        events: list[bytes] = []
        async with topo.session.post(topo.sidecar.url + "/v1/completions", json=body) as response:
            events.append(await response.content.readline())
            os.kill(topo.sidecar.pid, signal.SIGTERM)
            await until(lambda: refuses_connections(topo.sidecar.url), "the ingress to close")
            with pytest.raises(aiohttp.ClientConnectionError):
                await topo.post("/v1/completions", {"model": MODEL, "prompt": "late"}, timeout=5)
            async with topo.session.get(topo.sidecar.metrics + "/ready?verbose") as ready:
                assert ready.status == 503 and (await ready.json())["draining"] is True
            async for line in response.content:
                events.append(line)
        assert b"data: [DONE]\n" in events  # the open stream finished whole
        tokens = [e for e in events if e.startswith(b"data: {") and b'"text"' in e]
        assert len(tokens) >= 40
        assert await topo.sidecar.wait_exit(timeout_s=15) == 0


async def test_several_extproc_workers_share_the_streams_and_one_metrics_page() -> None:
    async with topology(extproc={"workers": 2}) as topo:
        body = {"model": MODEL, "prompt": "workers", "max_tokens": 2}
        name = "pd_extproc_processing_seconds_count"
        sent, served, page = 0, [0.0, 0.0], {}

        async def both_served() -> bool:
            """Four more requests; True once Envoy has given both processes some (a worker
            joins the rotation at its first passing health check, every 5 s). The process that
            handled a stream times its body answer; the pod's page shows both, by `worker`."""
            nonlocal sent, served, page
            results = await asyncio.gather(*(topo.post("/v1/completions", body) for _ in range(4)))
            assert [status for status, _, _ in results] == [200] * 4
            sent += 4
            page = await scrape(topo.session, topo.sidecar.metrics + "/metrics")
            served = [page.get(f'{name}{{worker="{w}"}}', 0.0) for w in ("0", "1")]
            return all(served)

        await until(both_served, "both ext_proc processes to serve requests", timeout_s=30)
        assert sum(served) == sent, (served, sent)
        assert page['pd_extproc_worker_up{worker="1"}'] == 1
        [worker] = topo.sidecar.worker_metrics
        own = await scrape(topo.session, worker + "/metrics")  # the worker's page, unlabelled
        assert own[name] == served[1]


async def test_more_workers_than_cpus_are_worded_at_start() -> None:
    """One ext_proc process per CPU the process may use: `up` pinned to one CPU says that two
    workers would take turns on it (they still start)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # the engines and `up` inherit it
    try:
        async with topology(extproc={"workers": 2}) as topo:
            status, _, _ = await topo.post("/v1/completions", {"model": MODEL, "prompt": "x"})
            assert status == 200
            assert (
                "extproc.workers is 2 but this process may use 1 CPU(s)" in topo.sidecar.log_text()
            )
    finally:
        os.sched_setaffinity(0, before)
