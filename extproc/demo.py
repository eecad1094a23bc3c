"""`pd-extproc demo`: the embedded default, with nothing to configure.

Starts two simulated push prefill engines and two decode engines (`vllmsim`), Envoy and the
ext_proc, sends a few requests and prints, per request, when each leg reached its engine and
the time to first token, so the parallel dispatch can be seen. Then it stays up for curl,
or exits with `--once`.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

import aiohttp

from extproc.config import parse_config
from extproc.process.app import Sidecar
from vllmsim.launcher import PUSH_D, PUSH_P, EngineHandle, running_engine

__all__ = ["run_demo"]

PROMPT = "Explain prefill/decode disaggregation in one paragraph. " * 40  # ~400 tokens


async def _first_token_time(session: aiohttp.ClientSession, url: str, i: int) -> float:
    """Stream one completion; seconds from sending to the first content chunk."""
    body = {
        "model": "sim-model",
        "prompt": f"Request {i}: {PROMPT}",
        "max_tokens": 16,
        "stream": True,
        "temperature": 0,
    }
    started = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - started
    return first if first is not None else float("nan")


Records = dict[str, dict[str, tuple[int, dict[str, Any]]]]  # request id -> leg kind -> record


async def _records(session: aiohttp.ClientSession, engines: list[EngineHandle]) -> Records:
    seen: Records = {}
    for index, engine in enumerate(engines):
        async with session.get(engine.url + "/sim/requests") as response:
            for record in await response.json():
                rid = record["x_request_id"] or ""
                if not rid.startswith("pd-extproc-probe-"):
                    seen.setdefault(rid, {})[record["kv"] or "?"] = (index, record)
    return seen


def _timeline(records: Records, ttfts: list[float], prefills: int) -> list[str]:
    lines = ["req  prefill  decode  D arrival - P arrival  how D got its KV   TTFT"]
    rows = sorted(records.values(), key=lambda legs: legs["prefill"][1]["received_at"])
    for n, legs in enumerate(rows):
        p_index, p = legs["prefill"]
        d_kind, (d_index, d) = next((k, v) for k, v in legs.items() if k != "prefill")
        skew_ms = (d["received_at"] - p["received_at"]) * 1e3
        lines.append(
            f"{n + 1:>3}  P{p_index + 1:<7} D{d_index - prefills + 1:<6} {skew_ms:>+14.2f} ms"
            f"      {d_kind:<16} {ttfts[n] * 1e3:>6.1f} ms"
        )
    return lines


# The simulator's 8B-class GPU profile, fitted to vllm-project/router PR #187's push table.
DEMO_PROFILE = "gpu-8b"


async def run_demo(stop: asyncio.Event, once: bool, requests: int, port: int) -> int:
    async with contextlib.AsyncExitStack() as stack:
        print(
            "starting 2 prefill + 2 decode simulated vLLM engines (NixlPushConnector, "
            f"cost profile {DEMO_PROFILE})..."
        )
        engines = [
            await stack.enter_async_context(
                running_engine("--kv-transfer-config", connector, "--profile", DEMO_PROFILE)
            )
            for connector in (PUSH_P, PUSH_P, PUSH_D, PUSH_D)
        ]
        config = parse_config(
            {
                "prefill": {"endpoints": [f"127.0.0.1:{e.port}" for e in engines[:2]]},
                "decode": {"endpoints": [f"127.0.0.1:{e.port}" for e in engines[2:]]},
                # The demo shows the two legs; by default an idle D would serve these short
                # prompts alone (faster than the P/D round trip), so it turns that off.
                "decision": {"mode": "off"},
                "extproc": {"port": 0},
                "metrics": {"port": 0},
                "envoy": {"listen": {"port": port}},
            }
        )
        sidecar = Sidecar(config, listen_setting="--port")
        await sidecar.bind()
        addresses = await sidecar.start()
        stack.push_async_callback(sidecar.stop)
        learned = sum(1 for i in sidecar.runtime.identities.snapshot().values() if i["engine_id"])
        print(
            f"Envoy + ext_proc up at {addresses.url}; {learned} of 2 prefill identities "
            "learned by probe before the first request"
        )
        session = await stack.enter_async_context(aiohttp.ClientSession())
        ttfts = [await _first_token_time(session, addresses.url, i) for i in range(requests)]
        records = await _records(session, engines)
        if len(records) < requests:  # answered by something else on the port: say so, fail
            print(
                f"pd-extproc demo: only {len(records)} of {requests} requests reached this "
                f"demo's engines; is another process serving {addresses.url}? Stop it, or "
                "choose another port with --port",
                file=sys.stderr,
            )
            return 1
        print("\nEach request: both legs reach their engines together (skew), and D registers its")
        print("KV blocks with P while P is still computing (push-parallel = scenario 1).\n")
        print("\n".join(_timeline(records, ttfts, prefills=2)))
        print(f"\nmetrics: {addresses.metrics}/metrics   Envoy admin: {addresses.envoy_admin}")
        if once:
            return 0
        print(
            "\nTry it (Ctrl-C to stop):\n"
            f"  curl -s {addresses.url}/v1/completions -H 'content-type: application/json' \\\n"
            '    -d \'{"model":"sim-model","prompt":"Hello","max_tokens":16}\''
        )
        await stop.wait()
    return 0
