"""A consumer nobody here wrote reads the simulator's KV events: vllm-router 0.1.17's kv_aware
policy, subscribed to two simulated engines, sends a prompt to the engine whose prefix cache
holds it. Symmetric (each engine holds one prompt), so no tie-break can pass it by chance.
In the real-vLLM stage: the router venv and the tiny model are built on demand (~20 s)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.procs import free_port, running_process, wait_http_ok
from scripts.cached_envs import tiny_model, vllm_router_venv
from tests.vllmsim.kv_event_helpers import LOOPBACK_ENV, events_flag
from vllmsim.launcher import FAST, EngineHandle, running_engine

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(300)]

SYSTEM_A = "You are a careful assistant who answers briefly and cites sources. " * 12
SYSTEM_B = "Translate everything the user says into French, keeping the tone. " * 12


def router_argv(router: Path, model: Path, port: int, engines: list[EngineHandle]) -> list[str]:
    argv = [
        str(router),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--policy",
        "kv_aware",
        "--kv-event-model",
        str(model),
        "--log-level",
        "info",
        "--worker-startup-check-interval",
        "1",
        "--worker-urls",
        *(e.url for e in engines),
    ]
    for e in engines:
        argv += [
            "--kv-event-source",
            f"{e.url}={e.kv_events_endpoint}",
            "--kv-event-replay-source",
            f"{e.url}={e.kv_events_replay_endpoint}",
        ]
    return argv


async def served(http: aiohttp.ClientSession, eng: EngineHandle, marker: str) -> int:
    """How many completions this engine served whose prompt ends with `marker`."""
    async with http.get(eng.url + "/sim/requests") as resp:
        records: list[dict[str, Any]] = await resp.json()
    return sum(
        1
        for r in records
        if r.get("path") == "/v1/completions"
        and str((r.get("body") or {}).get("prompt", "")).endswith(marker)
    )


async def test_kv_aware_routes_to_the_engine_holding_the_prefix() -> None:
    model, router = tiny_model(), vllm_router_venv() / "bin" / "vllm-router"
    flags = (
        *FAST,
        "--tokenizer",
        str(model),
        "--served-model-name",
        "tiny",
        *events_flag(topic=""),
    )
    async with (
        running_engine(*flags, env=LOOPBACK_ENV) as e1,
        running_engine(*flags, env=LOOPBACK_ENV) as e2,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="kv-router-") as tmp:
            log = Path(tmp) / "router.log"
            async with running_process(router_argv(router, model, port, [e1, e2]), log) as proc:
                await wait_http_ok(f"http://127.0.0.1:{port}/health", 60, proc)
                # each engine computes one system prompt, straight (the router sees the events)
                for eng, system in ((e2, SYSTEM_A), (e1, SYSTEM_B)):
                    async with http.post(
                        eng.url + "/v1/completions",
                        json={"model": "tiny", "prompt": system, "max_tokens": 1},
                    ) as resp:
                        assert resp.status == 200
                for turn in range(3):
                    for system, marker in ((SYSTEM_A, f"A{turn}?"), (SYSTEM_B, f"B{turn}?")):
                        async with http.post(
                            f"http://127.0.0.1:{port}/v1/completions",
                            json={"model": "tiny", "prompt": system + marker, "max_tokens": 1},
                        ) as resp:
                            assert resp.status == 200, await resp.text()
                        holder, other = (e2, e1) if system is SYSTEM_A else (e1, e2)
                        counts = (
                            await served(http, holder, marker),
                            await served(http, other, marker),
                        )
                        assert counts == (1, 0), log.read_text()[-3000:]
