"""A real prefill engine restarts (new NIXL engine id): what the README promises for it holds
against real vLLM. Every request either gets a complete answer or a clean 503 with Retry-After
before any byte of a 200, none hangs, and afterwards the new identity is used.

Two ways the sidecar meets the restart:
- under a steady client stream: a request P still holds when it is told to stop gets P's own 500
  (vLLM fails what it holds while it shuts down), which reaches the client as 502 like any P 5xx;
  then P refuses connections while it is down (503 + Retry-After), its health check fails, and
  once it is back it is re-learned;
- between two health checks (the sidecar never saw P down): the next parallel requests carry the
  old identity to D, whose handshake with the new P fails, and P's answer names the new identity:
  503 + Retry-After (streamed requests too), and the request after that succeeds.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest

from scripts.real_vllm import restart_engine, start_again, stop_engine
from tests.real_vllm.clients import PATHS, PROMPTS, ask, body, parse, sse_events
from tests.support.real_vllm import EnginePool, Setup, by_source, engine_metrics, sidecar_for

pytestmark = [pytest.mark.real_vllm, pytest.mark.pair("push_restart"), pytest.mark.timeout(900)]

PREFILL_TIMEOUT_S = 20
# Longest any client request may take: the P leg's timeout plus Envoy/ext_proc margins.
HANG_LIMIT_S = PREFILL_TIMEOUT_S + 10
# Health checks this far apart never run during a test: only a request can reveal the restart.
NO_HEALTH_CHECKS = {"interval_s": 3600.0}


@dataclass
class Outcome:
    stream: bool
    status: int
    started: float  # time.monotonic() when it was sent
    seconds: float
    retry_after: str | None
    complete: bool  # a 200 carrying the whole answer (a stream: usage, then [DONE], no error)
    detail: str  # the error message, or what is wrong with a 200

    def broken_promise(self, stopped_at: float) -> str | None:
        """What the README's rows for a restarted P rule out, or None. A request sent before P
        had stopped may be one P failed while shutting down: a 502 naming P's 500, or P's
        answer cut short there (its kv_transfer_params unusable)."""
        if self.status == 200:
            return None if self.complete else f"200 then {self.detail}"
        if (
            self.status == 502
            and self.started < stopped_at
            and any(why in self.detail for why in _SHUTDOWN_FAILURES)
        ):
            return None
        if self.status != 503 or not self.retry_after or not self.detail:
            return f"{self.status} (Retry-After {self.retry_after!r}): {self.detail}"
        return None


_SHUTDOWN_FAILURES = (" answered 500", "sent unusable kv_transfer_params")


def _error_message(raw: bytes) -> str:
    try:
        return str(orjson.loads(raw)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return f"not an OpenAI-style error: {raw[:200]!r}"


def _incomplete(raw: bytes, stream: bool) -> str:
    """Why a 200 body is not a whole answer ("" when it is)."""
    if not stream:
        return "" if parse("completions", 200, raw, False).prompt_tokens > 0 else "no usage"
    events = sse_events(raw)
    if any(e.startswith(b'{"error"') for e in events):
        return f"an in-stream error {events[-2][:200]!r}"
    if events[-1:] != [b"[DONE]"]:
        return f"a cut stream ({len(events)} events)"
    return "" if parse("completions", 200, raw, True).prompt_tokens > 0 else "no usage chunk"


async def request(setup: Setup, prompt: str, stream: bool) -> Outcome:
    started = time.monotonic()
    try:
        async with asyncio.timeout(HANG_LIMIT_S + 30):
            async with setup.session.post(
                setup.sidecar.url + PATHS["completions"], json=body("completions", prompt, stream)
            ) as response:
                status, retry_after = response.status, response.headers.get("Retry-After")
                try:
                    raw, cut = await response.read(), ""
                except aiohttp.ClientPayloadError as error:
                    raw, cut = b"", f"a cut body ({error})"
    except TimeoutError:
        return Outcome(stream, 0, started, time.monotonic() - started, None, False, "no answer")
    seconds = time.monotonic() - started
    if status != 200:
        return Outcome(stream, status, started, seconds, retry_after, False, _error_message(raw))
    detail = cut or _incomplete(raw, stream)
    return Outcome(stream, status, started, seconds, retry_after, not detail, detail)


async def identity(setup: Setup) -> str | None:
    async with setup.session.get(setup.sidecar.metrics + "/ready?verbose") as response:
        ready = await response.json()
    entry = ready["identities"].get(setup.prefill.address) or {}
    return entry.get("engine_id")


async def client_stream(setup: Setup, stop: asyncio.Event, log: list[Outcome]) -> None:
    """One request at a time until `stop`, alternating streamed and not."""
    i = 0
    while not stop.is_set():
        log.append(await request(setup, PROMPTS[i % len(PROMPTS)], stream=i % 2 == 1))
        i += 1
        await asyncio.sleep(0.2)


async def test_prefill_restart_under_load(pool: EnginePool, session: aiohttp.ClientSession) -> None:
    async with sidecar_for(
        pool, "push_restart", session, timeouts={"prefill_s": PREFILL_TIMEOUT_S}
    ) as setup:
        first = await ask(session, setup.sidecar.url, "completions", PROMPTS[0], stream=False)
        assert first.status == 200, first.raw
        old_id = await identity(setup)
        assert old_id

        stop, log = asyncio.Event(), []
        stream = asyncio.create_task(client_stream(setup, stop, log))
        try:
            await asyncio.to_thread(stop_engine, setup.prefill)
            stopped_at = time.monotonic()
            await asyncio.to_thread(start_again, setup.prefill)
            await wait_for_new_identity(setup, old_id)
            await asyncio.sleep(2)  # a few requests against the restarted engine
        finally:
            stop.set()
            await stream
        check_outcomes("restart under load", log, stopped_at)
        assert any(o.status == 503 for o in log), log  # the restart was actually seen
        assert log[-1].status == 200, log
        await check_after_restart(setup)


async def test_prefill_restart_between_health_checks(
    pool: EnginePool, session: aiohttp.ClientSession
) -> None:
    async with sidecar_for(
        pool,
        "push_restart",
        session,
        health=NO_HEALTH_CHECKS,
        timeouts={"prefill_s": PREFILL_TIMEOUT_S},
    ) as setup:
        first = await ask(session, setup.sidecar.url, "completions", PROMPTS[0], stream=False)
        assert first.status == 200, first.raw
        old_id = await identity(setup)
        assert old_id

        await asyncio.to_thread(restart_engine, setup.prefill)
        assert await identity(setup) == old_id  # nothing told the sidecar yet
        # Both leave with the old identity, before P's first answer can reveal the new one.
        caught = list(
            await asyncio.gather(
                request(setup, PROMPTS[1], stream=True), request(setup, PROMPTS[2], stream=False)
            )
        )
        check_outcomes("restart between health checks", caught, stopped_at=0.0)
        assert [o.status for o in caught] == [503, 503], caught
        assert await identity(setup) not in (None, old_id)
        await check_after_restart(setup)


async def wait_for_new_identity(setup: Setup, old_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (current := await identity(setup)) in (None, old_id):
        assert time.monotonic() < deadline, f"identity not re-learned: {current}"
        await asyncio.sleep(0.5)


def check_outcomes(name: str, log: list[Outcome], stopped_at: float) -> None:
    statuses = [o.status for o in log]
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    slowest = max(o.seconds for o in log)
    print(f"\n{name}: {len(log)} requests, statuses {counts}, slowest {slowest:.2f} s")
    assert slowest < HANG_LIMIT_S, log
    broken = [
        (i, o.stream, problem)
        for i, o in enumerate(log)
        if (problem := o.broken_promise(stopped_at)) is not None
    ]
    assert not broken, broken


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
