"""Burst of large bodies: N concurrent requests of S MB each through Envoy and the ext_proc.

1 prefill + 1 decode vllmsim push engine, `pd-extproc up`. Each body is a chat completion whose
user message carries an image as a base64 data URL of S MB (the simulator does not count image
parts as tokens, so the engines stay cheap and the time goes to Envoy and the ext_proc, as with
a real multimodal body). All N requests are sent at once; the script prints, per burst, how many
got 200 and what the others got.

    python scripts/burst.py 12x10 200x0.5 [--message-timeout 1] [--connect-timeout 1]
                            [--max-body-mb 16]

`--message-timeout` and `--connect-timeout` set `timeouts.extproc_message_s` and
`timeouts.connect_s` (default: the config's own defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.bootstrap.ext_proc_filter import extproc_message_timeout_s
from extproc.config import parse_config
from extproc.testing import ephemeral_config, running_sidecar
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, running_engine

CLIENT_DEADLINE_S = 300.0


def body(megabytes: float) -> bytes:
    size = int(megabytes * 1e6)
    image = base64.b64encode(b"\x89PNG" + bytes(size * 3 // 4))[:size]
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "describe this image"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image.decode()}},
        ],
    }
    return orjson.dumps({"model": "sim-model", "messages": [message], "max_tokens": 4})


async def one(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[str, float]:
    started = time.perf_counter()
    try:
        async with session.post(
            url + "/v1/chat/completions",
            data=data,
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=CLIENT_DEADLINE_S),
        ) as response:
            payload = await response.read()
            outcome = "200" if response.status == 200 else _error(response.status, payload)
    except (TimeoutError, aiohttp.ClientError) as error:
        outcome = f"client error {type(error).__name__}"
    return outcome, time.perf_counter() - started


def _error(status: int, payload: bytes) -> str:
    try:
        error = orjson.loads(payload)["error"]
        return f"{status} (code {error['code']}): {error['message'][:70]}"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return f"{status} {payload[:70]!r}"


async def floods(session: aiohttp.ClientSession, admin: str) -> int:
    """Envoy's count of ext_proc connections it closed for queueing too many HTTP/2 frames."""
    async with session.get(admin + "/stats?filter=pd_extproc.http2.outbound_flood") as response:
        text = await response.text()
    return sum(int(line.rpartition(" ")[2]) for line in text.splitlines() if line)


async def burst(url: str, n: int, megabytes: float, admin: str | None = None) -> None:
    data = body(megabytes)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        flooded = await floods(session, admin) if admin else 0
        results = await asyncio.gather(*(one(session, url, data) for _ in range(n)))
        flooded = await floods(session, admin) - flooded if admin else 0
    outcomes = Counter(outcome for outcome, _ in results)
    times = sorted(elapsed for _, elapsed in results)
    failed = n - outcomes["200"]
    print(
        f"{n} x {megabytes:g} MB ({len(data) / 1e6:.2f} MB bodies): {outcomes['200']} passed, "
        f"{failed} failed; latency median {times[n // 2]:.2f} s, "
        f"max {times[-1]:.2f} s",
        flush=True,
    )
    for outcome, count in outcomes.items():
        if outcome != "200":
            print(f"    {count} x {outcome}")
    if flooded:
        print(f"    Envoy closed the ext_proc connection {flooded} x (HTTP/2 outbound flood)")


def parse_burst(text: str) -> tuple[int, float]:
    n, _, megabytes = text.partition("x")
    return int(n), float(megabytes)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bursts", nargs="+", type=parse_burst, help="NxMB, e.g. 12x10")
    parser.add_argument("--message-timeout", type=float, help="timeouts.extproc_message_s")
    parser.add_argument("--connect-timeout", type=float, help="timeouts.connect_s")
    parser.add_argument("--max-body-mb", type=float, default=16.0, help="limits.max_body_bytes")
    args = parser.parse_args()
    flags = ("--kv-transfer-config",)
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(running_engine(*flags, PUSH_P, *FAST))
        d = await stack.enter_async_context(running_engine(*flags, PUSH_D, *FAST))
        extra: dict[str, Any] = {
            "limits": {"max_body_bytes": int(args.max_body_mb * 2**20)},
            "health": {"interval_s": 2.0, "timeout_s": 1.0},  # the defaults, not the tests' 0.5
        }
        timeouts = {"extproc_message_s": args.message_timeout, "connect_s": args.connect_timeout}
        extra["timeouts"] = {key: value for key, value in timeouts.items() if value is not None}
        config = ephemeral_config([f"127.0.0.1:{p.port}"], [f"127.0.0.1:{d.port}"], **extra)
        sidecar = await stack.enter_async_context(running_sidecar(config, log_level="WARNING"))
        timeout = extproc_message_timeout_s(parse_config(config))
        print(
            f"Envoy's ext_proc message timeout: {timeout:g} s "
            f"(limits.max_body_bytes {args.max_body_mb:g} MiB)"
        )
        for n, megabytes in args.bursts:
            await burst(sidecar.url, n, megabytes, sidecar.envoy_admin)


if __name__ == "__main__":
    asyncio.run(main())
