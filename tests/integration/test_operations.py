"""Operations: graceful drain on SIGTERM, configuration reload on SIGHUP."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from tests.integration.conftest import MODEL, topology

SLOW = ("--step-base-ms", "40")


async def test_sigterm_drains_open_streams_and_refuses_new_requests() -> None:
    async with topology(engine_flags=SLOW, timeouts={"drain_s": 10}) as topo:
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 40, "stream": True}
        events: list[bytes] = []
        async with topo.session.post(topo.sidecar.url + "/v1/completions", json=body) as response:
            events.append(await response.content.readline())
            os.kill(topo.sidecar.pid, signal.SIGTERM)
            await asyncio.sleep(0.3)  # Envoy has stopped its ingress listener by now
            with pytest.raises(aiohttp.ClientConnectionError):
                await topo.post("/v1/completions", {"model": MODEL, "prompt": "late"}, timeout=5)
            async for line in response.content:
                events.append(line)
        assert b"data: [DONE]\n" in events  # the open stream finished whole
        tokens = [e for e in events if e.startswith(b"data: {") and b'"text"' in e]
        assert len(tokens) >= 40
        assert await topo.sidecar.wait_exit(timeout_s=15) == 0
