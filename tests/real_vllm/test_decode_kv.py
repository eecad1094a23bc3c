""" "P/D that isn't P/D" detection on real engines: the sidecar scrapes each decode engine's
prompt-token sources; a correct push pair shows share 1 and no alert, a decode engine started
without a KV connector shows share 0, an alert and a WARNING log line."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from extproc.testing import scrape
from tests.real_vllm.clients import PROMPTS, ask
from tests.support.real_vllm import EnginePool, Setup, sidecar_for

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

KV_CHECK = {"enabled": True, "interval_s": 1.0}
WAIT_S = 20.0


async def decode_kv(setup: Setup) -> dict[str, Any]:
    async with setup.session.get(setup.sidecar.metrics + "/ready?verbose") as response:
        ready = await response.json()
    return ready["decode_kv"][setup.decode.address]


async def wait_for_share(setup: Setup) -> dict[str, Any]:
    """The decode entry of /ready once a check window with new prompt tokens has been scored."""
    deadline = time.monotonic() + WAIT_S
    while (entry := await decode_kv(setup))["share"] is None:
        assert time.monotonic() < deadline, f"no kv share within {WAIT_S:g} s: {entry}"
        await asyncio.sleep(0.5)
    return entry


async def send_requests(setup: Setup, count: int = 4) -> None:
    for prompt in PROMPTS[:count]:
        answer = await ask(setup.session, setup.sidecar.url, "completions", prompt, stream=False)
        assert answer.status == 200, answer.raw


def sample(metrics: dict[str, float], name: str, endpoint: str) -> float | None:
    return metrics.get(f'{name}{{endpoint="{endpoint}"}}')


@pytest.mark.pair("push")
async def test_correct_push_pair_has_share_one_and_no_alert(
    pool: EnginePool, session: aiohttp.ClientSession
) -> None:
    async with sidecar_for(pool, "push", session, kv_check=KV_CHECK) as setup:
        await send_requests(setup)
        entry = await wait_for_share(setup)
        assert entry["share"] == pytest.approx(1.0), entry
        assert entry["alerts"] == 0, entry
        metrics = await scrape(session, setup.sidecar.metrics + "/metrics")
        endpoint = setup.decode.address
        share = sample(metrics, "pd_extproc_decode_kv_transfer_share", endpoint)
        assert share == pytest.approx(1.0), metrics
        alerts = sample(metrics, "pd_extproc_pd_recompute_alerts_total", endpoint)
        assert not alerts, metrics
        assert "WARNING extproc.engines.kv_check" not in setup.sidecar.log_text()


@pytest.mark.pair("push_plain_decode")
async def test_decode_without_kv_connector_raises_an_alert(
    pool: EnginePool, session: aiohttp.ClientSession
) -> None:
    async with sidecar_for(pool, "push_plain_decode", session, kv_check=KV_CHECK) as setup:
        await send_requests(setup)
        entry = await wait_for_share(setup)
        assert entry["share"] == 0, entry
        deadline = time.monotonic() + WAIT_S
        while (entry := await decode_kv(setup))["alerts"] == 0:
            assert time.monotonic() < deadline, entry
            await asyncio.sleep(0.5)
        metrics = await scrape(session, setup.sidecar.metrics + "/metrics")
        endpoint = setup.decode.address
        assert sample(metrics, "pd_extproc_decode_kv_transfer_share", endpoint) == 0, metrics
        alerts = sample(metrics, "pd_extproc_pd_recompute_alerts_total", endpoint)
        assert alerts is not None and alerts >= 1, metrics
        warnings = [
            line
            for line in setup.sidecar.log_text().splitlines()
            if "WARNING" in line and endpoint in line and "kv-transfer-config" in line
        ]
        assert warnings, setup.sidecar.log_text()[-3000:]
