"""Pull mode (NixlConnector) through Envoy + the ext_proc, serial dispatch, real engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.real_vllm.checks import (
    check_disaggregated_equals_aggregated,
    check_engine_logs_clean,
    check_no_expired_leases,
)
from tests.support.real_vllm import EnginePool, Setup, sidecar_for

pytestmark = [pytest.mark.real_vllm, pytest.mark.pair("pull"), pytest.mark.timeout(900)]


@pytest_asyncio.fixture(scope="module")
async def pull(pool: EnginePool, session: aiohttp.ClientSession) -> AsyncIterator[Setup]:
    async with sidecar_for(pool, "pull", session, dispatch={"mode": "auto"}) as setup:
        yield setup


async def test_serial_pull_output_equals_aggregated_and_kv_moved(pull: Setup) -> None:
    await check_disaggregated_equals_aggregated(pull, strategy="serial")


async def test_prefill_has_no_expired_leases(pull: Setup) -> None:
    await check_no_expired_leases(pull)


async def test_engine_logs_show_no_rejected_body(pull: Setup) -> None:
    check_engine_logs_clean(pull)
