#!/usr/bin/env python3
"""Time to first token through two pd-extproc versions on the same 1P1D push engines.

Made to show that holding D's response headers until P has answered (parallel dispatch)
costs no time to first token: a streaming D sends its headers at once, but its first token
needs P's KV, which P has pushed by the time it answers. Two sidecars (Envoy + ext_proc)
share one P and one D (vllmsim, default cost model); one runs this checkout, the other the
ext_proc package found under --baseline (e.g. `git archive main extproc | tar -x -C DIR`).
Requests alternate between the two, one at a time, so drift hits both alike. Per request:
time to the response headers and to the first streamed content chunk, from the client.

    .venv/bin/python scripts/header_hold_ttft.py --baseline DIR [--requests 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path

import aiohttp
import orjson

from extproc.testing import SidecarHandle, ephemeral_config, running_sidecar
from vllmsim.launcher import PUSH_D, PUSH_P, running_engine


async def streamed(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float]:
    """(seconds to the response headers, seconds to the first content chunk)."""
    started = time.perf_counter()
    first = None
    async with http.post(
        url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    ) as response:
        headers_at = time.perf_counter() - started
        response.raise_for_status()
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                choices = orjson.loads(line[6:])["choices"]
                if choices and choices[0]["text"]:
                    first = time.perf_counter() - started
    assert first is not None, "no content streamed"
    return headers_at, first


def line(name: str, samples: list[tuple[float, float]]) -> str:
    heads = statistics.median(s[0] for s in samples) * 1000
    ttfts = sorted(s[1] * 1000 for s in samples)
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))]
    ttft = statistics.median(ttfts)
    return (
        f"{name:<10} headers median {heads:6.1f} ms   TTFT median {ttft:6.1f} ms"
        f"  p90 {p90:6.1f} ms  (n={len(samples)})"
    )


async def run(args: argparse.Namespace) -> None:
    prompt = [1000 + i % 30000 for i in range(args.prompt_tokens)]
    body = orjson.dumps(
        {"model": "sim-model", "prompt": prompt, "max_tokens": args.output_tokens, "stream": True}
    )
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_P))
        d = await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_D))
        config = ephemeral_config(
            [f"127.0.0.1:{p.port}"], [f"127.0.0.1:{d.port}"], health={"interval_s": 5}
        )
        # PYTHONSAFEPATH: the working directory (maybe this checkout) must not come first
        baseline = {"PYTHONPATH": str(args.baseline.resolve()), "PYTHONSAFEPATH": "1"}
        sidecars: dict[str, SidecarHandle] = {
            "baseline": await stack.enter_async_context(running_sidecar(config, env=baseline)),
            "this": await stack.enter_async_context(running_sidecar(config)),
        }
        http = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        )
        for sidecar in sidecars.values():  # warm-up: connections, identity
            await streamed(http, sidecar.url, body)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in sidecars}
        for _ in range(args.requests):
            for name, sidecar in sidecars.items():
                samples[name].append(await streamed(http, sidecar.url, body))
        async with http.get(d.url + "/sim/requests") as response:
            kinds = [r["kv"] for r in await response.json()]
    print(
        f"1P1D push (vllmsim default cost model), {args.prompt_tokens}-token prompt, "
        f"{args.output_tokens} output tokens, streamed; D saw "
        f"{kinds.count('push-parallel')} of {len(kinds)} requests as push-parallel"
    )
    for name, got in samples.items():
        print(line(name, got))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline",
        type=Path,
        required=True,
        help="a directory holding the baseline's extproc package",
    )
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=8)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
