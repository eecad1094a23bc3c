#!/usr/bin/env python3
"""1P1D push with serial and parallel dispatch: median client-measured TTFT of each.

Starts two `vllmsim` processes (P and D, NixlPushConnector, default cost model), sends
plain HTTP (no router), and stops them. Both legs carry the same X-Request-Id and path.
Serial: P's response, then D with P's kv_transfer_params. Parallel: both legs at once,
D given the identity learned from a first serial request. TTFT is measured at the
client, from dispatch to the first streamed content chunk of D.

    .venv/bin/python scripts/push_overlap.py [--requests 15] [--prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

import aiohttp
import orjson

from vllmsim.launcher import PUSH_D, PUSH_P, EngineHandle, running_engine

IDENTITY = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size", "dcp_size")


def p_body(prompt: list[int]) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }


def d_body(prompt: list[int], out: int, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "prompt": prompt,
        "max_tokens": out,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": params,
    }


async def prefill(
    http: aiohttp.ClientSession, p: EngineHandle, prompt: list[int], rid: str
) -> dict[str, Any]:
    async with http.post(
        p.url + "/v1/completions", json=p_body(prompt), headers={"X-Request-Id": rid}
    ) as resp:
        resp.raise_for_status()
        return (await resp.json())["kv_transfer_params"]


async def decode_ttft(
    http: aiohttp.ClientSession, d: EngineHandle, body: dict[str, Any], rid: str, t0: float
) -> float:
    """Seconds from t0 to D's first content chunk; drains the stream."""
    first = None
    async with http.post(
        d.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}
    ) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.monotonic() - t0
    assert first is not None, "D streamed no content"
    return first


async def serial(
    http: aiohttp.ClientSession, p: EngineHandle, d: EngineHandle, prompt: list[int], out: int
) -> tuple[float, dict[str, Any]]:
    rid, t0 = str(uuid.uuid4()), time.monotonic()
    params = await prefill(http, p, prompt, rid)
    return await decode_ttft(http, d, d_body(prompt, out, params), rid, t0), params


async def parallel(
    http: aiohttp.ClientSession,
    p: EngineHandle,
    d: EngineHandle,
    prompt: list[int],
    out: int,
    ident: dict[str, Any],
) -> float:
    rid, t0 = str(uuid.uuid4()), time.monotonic()
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        **ident,
        "remote_request_id": rid,
    }  # placeholder, as llm-d and vLLM's demo proxy do
    p_leg = asyncio.ensure_future(prefill(http, p, prompt, rid))
    ttft = await decode_ttft(http, d, d_body(prompt, out, params), rid, t0)
    got = await p_leg
    assert all(got[k] == ident[k] for k in IDENTITY), "P's identity changed"
    return ttft


async def run(args: argparse.Namespace) -> None:
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    async with (
        running_engine("--kv-transfer-config", PUSH_P, env=env) as p,
        running_engine("--kv-transfer-config", PUSH_D, env=env) as d,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        prompt = [1000 + i % 30000 for i in range(args.prompt_tokens)]
        _, learned = await serial(http, p, d, prompt, args.output_tokens)  # learn P's identity
        ident = {k: learned[k] for k in IDENTITY}
        ser: list[float] = []
        par: list[float] = []
        for _ in range(args.requests):  # interleaved, so drift hits both modes alike
            ser.append((await serial(http, p, d, prompt, args.output_tokens))[0])
            par.append(await parallel(http, p, d, prompt, args.output_tokens, ident))
        async with http.get(d.url + "/sim/requests") as resp:
            kinds = [r["kv"] for r in await resp.json()]
    ms_s, ms_p = 1000 * statistics.median(ser), 1000 * statistics.median(par)
    print(f"1P1D push, {args.prompt_tokens}-token prompt, {args.requests} requests per mode")
    print(f"serial   median TTFT {ms_s:7.1f} ms  (D saw: {kinds.count('push-serial')} push-serial)")
    print(
        f"parallel median TTFT {ms_p:7.1f} ms  (D saw: {kinds.count('push-parallel')}"
        f" push-parallel)  -> {ms_s - ms_p:+.1f} ms"
    )
    print(
        "why: in parallel D allocates and registers (PUSH_REG) while P is still prefilling, so"
        " P's WRITE starts right after its prefill step instead of after P's response ->"
        " client -> D request -> D allocation -> registration round trip."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=15)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=8)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
