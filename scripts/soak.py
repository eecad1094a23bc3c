"""Soak: concurrent traffic through the sidecar while faults are injected at random.

2 prefill + 2 decode vllmsim push engines, Envoy and the ext_proc. Clients send streaming and
non-streaming requests (some hang up early on purpose); every few seconds a random fault hits
a random engine: a failing, hanging or slow prefill, a failing or hanging decode, dropped push
registrations, a restart (new engine id), refused connections. Every request has a client
deadline far above the sidecar's own bounds, so a request that reaches it is a hang.

At the end it prints one line: sent, succeeded, failed with a clear error, cut mid-stream,
client hang-ups, hung (must be 0), silent streams (a 200, then no byte for SILENT_S; must be
0), the in-flight counters (must be 0), the ext_proc's memory at start and end, and the
engines' blocks still held once their leases ran out (must be 0). `--faults restart` injects
prefill restarts only (`--stream-share 1`: every request streams).

    python scripts/soak.py [--seconds 600] [--concurrency 12] [--seed 1] [--faults restart,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.testing import SidecarHandle, ephemeral_config, running_sidecar
from vllmsim.launcher import EngineHandle, running_engine

LEASE_S = 5
PREFILL = (
    f'{{"kv_connector":"NixlPushConnector","kv_role":"kv_producer",'
    f'"kv_connector_extra_config":{{"kv_lease_duration":{LEASE_S}}}}}'
)
DECODE = '{"kv_connector":"NixlPushConnector","kv_role":"kv_consumer"}'
CLIENT_DEADLINE_S = 60.0  # the sidecar bounds everything well below this (see CONFIG)
CONFIG = {"timeouts": {"prefill_s": 5, "kv_wait_s": 10}, "health": {"interval_s": 1}}
SILENT_S = 8.0  # a 200 then no byte this long: a stream left waiting for KV (kv_wait_s cuts it)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one_request(
    session: aiohttp.ClientSession, url: str, rng: random.Random, stream_share: float
) -> str:
    stream = rng.random() < stream_share
    body = {
        "model": "sim-model",
        "prompt": "soak " * rng.randint(5, 400),
        "max_tokens": rng.randint(1, 40),
        "stream": stream,
    }
    hang_up = rng.random() < 0.05
    try:
        async with asyncio.timeout(CLIENT_DEADLINE_S):
            async with session.post(url + "/v1/completions", json=body) as response:
                if response.status != 200:
                    try:
                        payload = await response.json(content_type=None)
                    except ValueError:
                        return "unclear_error"
                    return "clear_error" if "error" in payload else "unclear_error"
                if hang_up:
                    await response.content.readany()
                    return "hung_up"
                first = b""
                if stream:  # the first bytes after the 200, within SILENT_S
                    try:
                        first = await asyncio.wait_for(response.content.readany(), SILENT_S)
                    except TimeoutError:
                        return "silent"
                text = (first + await response.read()).decode()
                if stream and "data: [DONE]" not in text:
                    return "clear_error" if '"error"' in text else "cut"
                return "ok"
    except TimeoutError:
        return "hung"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
        return "cut"  # an error after the 200 went out: Envoy resets the stream


async def inject(
    session: aiohttp.ClientSession,
    engines: list[EngineHandle],
    rng: random.Random,
    stop: asyncio.Event,
    log: Counter[str],
    only: set[str] | None,
) -> None:
    prefills, decodes = engines[:2], engines[2:]
    faults = [
        ("prefill_fail", prefills, {"fail_next": 3, "fail_status": 500}),
        ("prefill_hang", prefills, {"hang_next": 1}),
        ("prefill_slow", prefills, {"latency_ms": 2000}),
        ("decode_fail", decodes, {"fail_next": 2, "fail_status": 503}),
        ("decode_hang", decodes, {"hang_next": 1}),
        ("drop_registrations", prefills, {"drop_registrations": True}),
        ("refuse", prefills, {"refuse_connections": True, "refuse_for_s": 3}),
    ]
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(2, 6))
        if stop.is_set():
            return
        chosen = [f for f in [*faults, ("restart", prefills, None)] if not only or f[0] in only]
        name, targets, body = rng.choice(chosen)
        engine = rng.choice(targets)
        path = "/sim/restart" if body is None else "/sim/faults"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.post(
                engine.url + path, json=body or {}, timeout=aiohttp.ClientTimeout(total=5)
            ):
                log[name] += 1
            if name in ("prefill_slow", "drop_registrations"):  # lift them again later
                await asyncio.sleep(rng.uniform(1, 4))
                async with session.delete(engine.url + "/sim/faults"):
                    pass


async def settle(
    session: aiohttp.ClientSession, sidecar: SidecarHandle, engines: list[EngineHandle]
) -> tuple[int, int]:
    """Clear faults, wait out the leases; (in-flight count, blocks still held)."""
    for engine in engines:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.delete(engine.url + "/sim/faults"):
                pass
    await asyncio.sleep(LEASE_S * 2 + 2)
    async with session.get(sidecar.metrics + "/ready?verbose") as response:
        ready = await response.json()
    inflight = sum(e["in_flight"] for role in ("prefill", "decode") for e in ready[role].values())
    blocks = 0
    for engine in engines:
        async with session.get(engine.url + "/sim/state") as response:
            blocks += (await response.json())["blocks_used"]
    return inflight, blocks


async def main(
    seconds: float, concurrency: int, seed: int, only: set[str] | None, stream_share: float
) -> int:
    rng = random.Random(seed)
    flags = [("--kv-transfer-config", PREFILL)] * 2 + [("--kv-transfer-config", DECODE)] * 2
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(running_engine(*f)) for f in flags]
        config = ephemeral_config(
            [f"127.0.0.1:{e.port}" for e in engines[:2]],
            [f"127.0.0.1:{e.port}" for e in engines[2:]],
            **CONFIG,
        )
        sidecar = await stack.enter_async_context(running_sidecar(config, log_level="WARNING"))
        session = await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        )
        rss_start, results, faults = rss_mib(sidecar.pid), Counter[str](), Counter[str]()
        stop, deadline = asyncio.Event(), time.monotonic() + seconds

        async def client() -> None:
            while time.monotonic() < deadline:
                results[await one_request(session, sidecar.url, rng, stream_share)] += 1

        injector = asyncio.create_task(inject(session, engines, rng, stop, faults, only))
        await asyncio.gather(*(client() for _ in range(concurrency)))
        stop.set()
        await injector
        inflight, blocks = await settle(session, sidecar, engines)
        rss_end = rss_mib(sidecar.pid)
    sent = sum(results.values())
    print(
        f"soak {seconds:g} s, concurrency {concurrency}: sent {sent}, ok {results['ok']}, "
        f"clear errors {results['clear_error']}, cut mid-stream {results['cut']}, "
        f"client hang-ups {results['hung_up']}, unclear errors {results['unclear_error']}, "
        f"hung {results['hung']}, silent streams {results['silent']}; in-flight after {inflight}; "
        f"ext_proc RSS "
        f"{rss_start:.1f} -> {rss_end:.1f} MiB; blocks held after leases {blocks}; "
        f"faults {dict(faults)}"
    )
    clean = results["hung"] == results["silent"] == 0
    return 0 if clean and inflight == 0 and blocks == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", help="comma-separated fault names (default: all)")
    parser.add_argument("--stream-share", type=float, default=0.5, help="share of streams")
    args = parser.parse_args()
    only = set(args.faults.split(",")) if args.faults else None
    sys.exit(asyncio.run(main(args.seconds, args.concurrency, args.seed, only, args.stream_share)))
