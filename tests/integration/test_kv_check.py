""" "P/D that isn't P/D": the sidecar notices a decode engine that recomputes prompts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp

from extproc.testing import SidecarHandle, ephemeral_config, running_sidecar, scrape
from tests.support.engines import MODEL
from vllmsim.launcher import PUSH_D, PUSH_P, EngineHandle, running_engine

COMPLETION = {"model": MODEL, "prompt": "A prompt that should travel by KV " * 10, "max_tokens": 2}
KV_CHECK = {"interval_s": 0.3}


@contextlib.asynccontextmanager
async def pair(decode_flags: tuple[str, ...]) -> AsyncIterator[tuple[EngineHandle, SidecarHandle]]:
    async with (
        running_engine("--kv-transfer-config", PUSH_P) as p,
        running_engine(*decode_flags) as d,
        running_sidecar(
            ephemeral_config([f"127.0.0.1:{p.port}"], [f"127.0.0.1:{d.port}"], kv_check=KV_CHECK)
        ) as sidecar,
    ):
        yield d, sidecar


async def drive_and_wait(sidecar: SidecarHandle, d: EngineHandle) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        for _ in range(5):
            async with session.post(sidecar.url + "/v1/completions", json=COMPLETION) as response:
                assert response.status == 200, await response.text()
        share_key = f'pd_extproc_decode_kv_transfer_share{{endpoint="127.0.0.1:{d.port}"}}'
        for _ in range(40):  # a few check windows, bounded
            metrics = await scrape(session, sidecar.metrics + "/metrics")
            if share_key in metrics:
                return metrics | {"share": metrics[share_key]}
            await asyncio.sleep(0.1)
    raise AssertionError("no kv_transfer_share exported")


async def test_real_pd_has_full_share_and_no_alert() -> None:
    async with pair(("--kv-transfer-config", PUSH_D)) as (d, sidecar):
        metrics = await drive_and_wait(sidecar, d)
        assert metrics["share"] == 1.0
        assert not any(k.startswith("pd_extproc_pd_recompute_alerts_total") for k in metrics)
        assert "computed" not in sidecar.log_text()


async def test_decode_without_connector_is_reported() -> None:
    async with pair(()) as (d, sidecar):
        metrics = await drive_and_wait(sidecar, d)
        assert metrics["share"] == 0.0
        alerts = f'pd_extproc_pd_recompute_alerts_total{{endpoint="127.0.0.1:{d.port}"}}'
        for _ in range(20):
            if metrics.get(alerts, 0) >= 1 and "computed" in sidecar.log_text():
                break
            await asyncio.sleep(0.2)
            async with aiohttp.ClientSession() as session:
                metrics = await scrape(session, sidecar.metrics + "/metrics")
        assert metrics.get(alerts, 0) >= 1
        assert "same KV connector" in sidecar.log_text()
