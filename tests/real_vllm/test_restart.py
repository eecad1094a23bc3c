"""A real prefill engine restarts (new NIXL engine id) under a steady client stream: no request
hangs, failures are quick retryable statuses, and afterwards the new identity is used."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from scripts.real_vllm import restart_engine
from tests.real_vllm.clients import PROMPTS, ask
from tests.real_vllm.conftest import EnginePool, Setup, by_source, engine_metrics, sidecar_for

pytestmark = [pytest.mark.real_vllm, pytest.mark.pair("push_restart"), pytest.mark.timeout(900)]

PREFILL_TIMEOUT_S = 20
# Longest any client request may take: the P leg's timeout plus Envoy/ext_proc margins.
HANG_LIMIT_S = PREFILL_TIMEOUT_S + 10
RETRYABLE = {502, 503, 504}


async def identity(setup: Setup) -> str | None:
    async with setup.session.get(setup.sidecar.metrics + "/ready") as response:
        ready = await response.json()
    entry = ready["identities"].get(setup.prefill.address) or {}
    return entry.get("engine_id")


async def client_stream(setup: Setup, stop: asyncio.Event, log: list[tuple[int, float]]) -> None:
    """One request at a time until `stop`, recording (status, seconds) of each."""
    i = 0
    while not stop.is_set():
        started = time.monotonic()
        try:
            answer = await asyncio.wait_for(
                ask(setup.session, setup.sidecar.url, "completions", PROMPTS[i % len(PROMPTS)],
                    stream=i % 2 == 1), HANG_LIMIT_S + 30)
            log.append((answer.status, time.monotonic() - started))
        except TimeoutError:
            log.append((0, time.monotonic() - started))
        i += 1
        await asyncio.sleep(0.2)


async def test_prefill_restart_hangs_no_request(
    pool: EnginePool, session: aiohttp.ClientSession
) -> None:
    async with sidecar_for(pool, "push_restart", session,
                           timeouts={"prefill_s": PREFILL_TIMEOUT_S}) as setup:
        first = await ask(session, setup.sidecar.url, "completions", PROMPTS[0], stream=False)
        assert first.status == 200, first.raw
        old_id = await identity(setup)
        assert old_id

        stop, log = asyncio.Event(), []
        stream = asyncio.create_task(client_stream(setup, stop, log))
        try:
            await asyncio.to_thread(restart_engine, setup.prefill)
            await wait_for_new_identity(setup, old_id)
            await asyncio.sleep(2)  # a few requests against the restarted engine
        finally:
            stop.set()
            await stream
        await check_stream(log)
        await check_after_restart(setup)


async def wait_for_new_identity(setup: Setup, old_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (current := await identity(setup)) in (None, old_id):
        assert time.monotonic() < deadline, f"identity not re-learned: {current}"
        await asyncio.sleep(0.5)


async def check_stream(log: list[tuple[int, float]]) -> None:
    statuses = [status for status, _ in log]
    slowest = max(seconds for _, seconds in log)
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"\nrestart: {len(log)} requests, statuses {counts}, slowest {slowest:.2f} s")
    assert slowest < HANG_LIMIT_S, log
    assert set(statuses) <= {200} | RETRYABLE, log
    assert any(s in RETRYABLE for s in statuses), log  # the restart was actually seen
    assert statuses[-1] == 200, log


async def check_after_restart(setup: Setup) -> None:
    """Disaggregation works again with the new engine: output right, KV moved."""
    expected = await ask(setup.session, setup.prefill.url, "chat", PROMPTS[3], stream=False)
    before = by_source(await engine_metrics(setup.session, setup.decode))
    answer = await ask(setup.session, setup.sidecar.url, "chat", PROMPTS[3], stream=True)
    after = by_source(await engine_metrics(setup.session, setup.decode))
    assert answer.status == 200 and answer.text == expected.text, answer.raw[:500]
    moved: dict[str, Any] = {s: after[s] - before.get(s, 0.0) for s in after}
    assert moved["external_kv_transfer"] == answer.prompt_tokens, moved
    assert moved["local_compute"] == 0, moved
