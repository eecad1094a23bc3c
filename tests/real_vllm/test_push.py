"""Push mode (NixlPushConnector) through Envoy + the ext_proc, parallel dispatch, real engines."""

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

pytestmark = [pytest.mark.real_vllm, pytest.mark.pair("push"), pytest.mark.timeout(900)]


@pytest_asyncio.fixture(scope="module")
async def push(pool: EnginePool, session: aiohttp.ClientSession) -> AsyncIterator[Setup]:
    async with sidecar_for(pool, "push", session, dispatch={"mode": "auto"}) as setup:
        yield setup


async def test_parallel_push_output_equals_aggregated_and_kv_moved(push: Setup) -> None:
    await check_disaggregated_equals_aggregated(push, strategy="parallel")


async def test_prefill_has_no_expired_leases(push: Setup) -> None:
    await check_no_expired_leases(push)


async def test_engine_logs_show_no_rejected_body(push: Setup) -> None:
    check_engine_logs_clean(push)
