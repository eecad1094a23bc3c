"""What Envoy + the ext_proc add to a request, and how far apart the two legs leave.

Engines: one push prefill and one push decode `vllmsim` with near-instant steps, so the
figures are the proxy's, not the model's. Three paths, interleaved in rounds, sequential:

  aggregated  the client sends the plain request straight to D (no P/D at all)
  direct P/D  the client itself sends both legs at once (same bodies and ids the sidecar uses)
  sidecar     the client sends the plain request to Envoy; the ext_proc does the rest

"added" = sidecar - direct P/D, at the same percentile: the cost of Envoy + the ext_proc for
the same protocol work. Skew = D's arrival - P's arrival at the engines (their own clocks).

    python bench/overhead.py [--requests 300] [--rounds 5] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procs import run_bench
from extproc.testing import ephemeral_config, running_sidecar
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, EngineHandle, running_engine

BODY = {"model": "sim-model", "prompt": "benchmark prompt " * 64, "max_tokens": 4}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def timed_post(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict) -> float:
    started = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as response:
        await response.read()
        assert response.status == 200, response.status
    return time.perf_counter() - started


async def direct_pd(
    session: aiohttp.ClientSession, p: EngineHandle, d: EngineHandle, identity: dict
) -> float:
    rid = str(uuid.uuid4())
    xfer = f"xfer-{uuid.uuid4()}"
    headers = {"content-type": "application/json", "x-request-id": rid}
    p_body = orjson.dumps(
        BODY
        | {
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": xfer,
            },
        }
    )
    d_body = orjson.dumps(
        BODY | {"kv_transfer_params": identity | {"remote_request_id": rid, "transfer_id": xfer}}
    )
    started = time.perf_counter()
    prefill = asyncio.create_task(timed_post(session, p.url + "/v1/completions", p_body, headers))
    await timed_post(session, d.url + "/v1/completions", d_body, headers)
    elapsed = time.perf_counter() - started
    await prefill
    return elapsed


async def learn_identity(session: aiohttp.ClientSession, p: EngineHandle) -> dict:
    body = BODY | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    async with session.post(p.url + "/v1/completions", json=body) as response:
        params = (await response.json())["kv_transfer_params"]
    keys = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size", "dcp_size")
    return {"do_remote_prefill": True, "do_remote_decode": False} | {k: params[k] for k in keys}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def skews(session: aiohttp.ClientSession, p: EngineHandle, d: EngineHandle) -> list[float]:
    async with session.get(p.url + "/sim/requests") as response:
        p_seen = {r["x_request_id"]: r["received_at"] for r in await response.json()}
    async with session.get(d.url + "/sim/requests") as response:
        d_seen = await response.json()
    return [
        abs(r["received_at"] - p_seen[r["x_request_id"]])
        for r in d_seen
        if r["x_request_id"] in p_seen and r["body"].get("kv_transfer_params")
    ]


async def main(requests: int, rounds: int, out: Path) -> None:
    async with (
        running_engine("--kv-transfer-config", PUSH_P, *FAST) as p,
        running_engine("--kv-transfer-config", PUSH_D, *FAST) as d,
        running_sidecar(
            ephemeral_config([f"127.0.0.1:{p.port}"], [f"127.0.0.1:{d.port}"]), log_level="WARNING"
        ) as sidecar,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        identity = await learn_identity(session, p)
        plain = orjson.dumps(BODY)
        json_headers = {"content-type": "application/json"}
        paths = {
            "aggregated (client -> D)": lambda: timed_post(
                session, d.url + "/v1/completions", plain, json_headers
            ),
            "direct P/D (client sends both legs)": lambda: direct_pd(session, p, d, identity),
            "sidecar (client -> Envoy + ext_proc)": lambda: timed_post(
                session, sidecar.url + "/v1/completions", plain, json_headers
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for run in paths.values():  # warm-up: connections, handshakes
            for _ in range(20):
                await run()
        for session_url in (p.url, d.url):
            async with session.delete(session_url + "/sim/requests"):
                pass
        cpu_before = cpu_seconds(sidecar.pid)
        for _ in range(rounds):
            for name, run in paths.items():
                for _ in range(requests // rounds):
                    times[name].append(await run())
        cpu_per_request = (cpu_seconds(sidecar.pid) - cpu_before) / len(times[list(paths)[2]])
        skew = await skews(session, p, d)
    report(times, skew, cpu_per_request, out)


def report(times: dict[str, list[float]], skew: list[float], cpu: float, out: Path) -> None:
    names = list(times)
    direct, via = times[names[1]], times[names[2]]
    lines = [
        f"# Overhead: {len(via)} sequential requests per path, instant vllmsim engines (ms)",
        "",
        "| path | p50 | p90 | p99 |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        lines.append(
            f"| {name} | {percentile(values, 50) * 1e3:.2f} | "
            f"{percentile(values, 90) * 1e3:.2f} | {percentile(values, 99) * 1e3:.2f} |"
        )
    lines += [
        "",
        f"added by Envoy + ext_proc (sidecar - direct P/D): p50 "
        f"{(percentile(via, 50) - percentile(direct, 50)) * 1e3:+.2f} ms, p99 "
        f"{(percentile(via, 99) - percentile(direct, 99)) * 1e3:+.2f} ms",
        f"dispatch skew |D arrival - P arrival| over {len(skew)} sidecar + direct requests: "
        f"p50 {percentile(skew, 50) * 1e3:.2f} ms, p99 {percentile(skew, 99) * 1e3:.2f} ms, "
        f"max {max(skew) * 1e3:.2f} ms",
        f"ext_proc CPU per request (sidecar process, user+system): {cpu * 1e3:.2f} ms",
        f"mean of direct P/D {statistics.mean(direct) * 1e3:.2f} ms, "
        f"sidecar {statistics.mean(via) * 1e3:.2f} ms",
    ]
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.md").write_text(text + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    run_bench(main(args.requests, args.rounds, args.out))
