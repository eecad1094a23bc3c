#!/usr/bin/env python3
"""Proxy overhead and hot path: pd-extproc against vllm-router on instant vllmsim engines.

One 1P1D push topology whose engines answer in ~1 ms, so the figures are the proxies':

  1. sequential requests, interleaved in rounds: latency of aggregated (client → D), direct P/D
     (the client sends both legs itself), pd-extproc (push; its P leg straight to the engine,
     and through Envoy's prefill listener), vllm-router, and the floors: a do-nothing ext_proc
     behind the same Envoy, with pd-extproc's messages and with the fewest Envoy allows
     (`bench/floor_extproc.py`; pd-extproc's figures as ratios to them); added latency =
     proxy − direct P/D at p50 and p99; dispatch skew |D arrival − P arrival| from each engine's
     GET /sim/requests; CPU seconds per request of the ext_proc, of its Envoy and of the router.
  2. open-loop rate steps: the highest rate at which each proxy's p99 added latency stays < 5 ms.
  3. a py-spy profile of the ext_proc process under open-loop load, top self/inclusive costs.

    python bench/hotpath.py [--requests 400] [--rates 20,40,60,80,100,125,150] [--step-s 10]

`--kv-approx` adds kv_cache on both pools with no KV events and no tokenizer, twice: routing by
what the sidecar sent where (`kv_approximate`, its per-request cost: hashing the prompt's bytes,
the lookup, remembering where it went) and by the prompt-start hash alone (the same policy and
scrapes without it), so that the difference of the two rows is the estimate's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import pyspy, wire
from bench.engines import INSTANT, Engines, clear_sim_requests, running_engines, sim_requests
from bench.openloop import open_loop, percentile
from bench.overhead import BODY, direct_pd, learn_identity
from bench.procs import child_pids, cpu_seconds, pinned, run_bench
from bench.run import cpu_split
from bench.targets import Target, running_extproc, running_floor, running_target
from extproc.config import HealthConfig
from scripts.cached_envs import vllm_router_venv

RESULTS = Path(__file__).resolve().parent / "results"
ROLES = ("prefill", "decode")
PROXIES = ["pd-extproc", "vllm-router"]  # extended by --listener-leg, --baseline, --workers
# pd-extproc as a user runs it: the product's health checks (every 2 s), not the tests' 0.5 s,
# whose background checks cost ~0.1 ms of the CPU per request measured here.
HEALTH = HealthConfig().model_dump()
LISTENER_LEG = "pd-extproc (P leg via listener)"  # pd-extproc's default sends P straight
ADDED_P99_LIMIT_MS = 5.0
# The do-nothing ext_procs (`bench/floor_extproc.py`) by mode: pd-extproc's processing mode,
# and the fewest messages Envoy allows for the job.
FLOORS = {"same": "floor, pd-extproc's messages", "fewest": "floor, fewest messages"}
# The aims: within this factor of the floor, and these absolute figures.
FLOOR_FACTOR = 1.25
AIM_TO_PREFILL_MS = 1.0
AIM_CPU_MS = 2.0
# --kv-approx: kv_cache with no events or tokenizer, with and without the sent-bytes estimate
KV_APPROX = (("kv_cache, prompt-start hash", False), ("kv_cache, sent-bytes estimate", True))


@dataclass
class PathStats:
    latencies: list[float] = field(default_factory=list)
    skews: list[float] = field(default_factory=list)  # engines' arrival clocks
    wire_skews: list[float] = field(default_factory=list)  # D − P, kernel stamps of 1st segments
    to_prefill: list[float] = field(default_factory=list)  # client at the proxy → P leg out
    windows: list[tuple[float, float]] = field(default_factory=list)  # wall-clock spans measured
    cpu: dict[str, float] = field(default_factory=dict)  # process name → CPU seconds


async def timed(session: aiohttp.ClientSession, url: str) -> float:
    """One plain request through `url`, with a fresh X-Request-Id (both proxies may keep it)."""
    headers = {"content-type": "application/json", "x-request-id": str(uuid.uuid4())}
    started = time.perf_counter()
    async with session.post(
        url + "/v1/completions", data=orjson.dumps(BODY), headers=headers
    ) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}")
    return time.perf_counter() - started


async def leg_skews(session: aiohttp.ClientSession, engines: Engines) -> list[float]:
    """|D arrival − P arrival| per P/D request pair seen by the engines since the last clear."""
    p_seen = {
        r["x_request_id"]: r["received_at"] for r in await sim_requests(session, engines.prefill[0])
    }
    d_seen = await sim_requests(session, engines.decode[0])
    return [
        abs(r["received_at"] - p_seen[r["x_request_id"]])
        for r in d_seen
        if r["x_request_id"] in p_seen
    ]


def proxy_pids(targets: dict[str, Target]) -> dict[str, dict[str, int]]:
    """Per path, the processes whose CPU it costs: `pd-extproc up` is the first ext_proc, and
    its children are Envoy and the extra ext_proc workers."""
    pids: dict[str, dict[str, int]] = {}
    for name, target in targets.items():
        assert target.pid is not None
        if name == "vllm-router":
            pids[name] = {"vllm-router": target.pid}
            continue
        pids[name] = {"ext_proc": target.pid}
        for index, child in enumerate(child_pids(target.pid)):
            comm = Path(f"/proc/{child}/comm").read_text().strip()
            pids[name]["envoy" if comm == "envoy" else f"worker{index}"] = child
    return pids


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


async def measured(
    run: Callable[[], Awaitable[float]], n: int, stats: PathStats, pids: dict[str, int]
) -> None:
    """n sequential requests; their latencies and the CPU the path's processes spent."""
    before = cpu_snapshot(pids)
    for _ in range(n):
        stats.latencies.append(await run())
    for name, value in cpu_snapshot(pids).items():
        stats.cpu[name] = stats.cpu.get(name, 0.0) + value - before[name]


async def sequential(
    paths: dict[str, Callable[[], Awaitable[float]]],
    engines: Engines,
    session: aiohttp.ClientSession,
    pids: dict[str, dict[str, int]],
    requests: int,
    rounds: int,
) -> dict[str, PathStats]:
    stats = {name: PathStats() for name in paths}
    for _ in range(rounds):
        for name, run in paths.items():
            await clear_sim_requests(session, engines)
            began = time.time()
            await measured(run, requests // rounds, stats[name], pids.get(name, {}))
            stats[name].windows.append((began, time.time()))
            if name != "aggregated (client → D)":
                stats[name].skews += await leg_skews(session, engines)
    return stats


@dataclass(frozen=True)
class RateRow:
    rate: float
    achieved: dict[str, float]
    p50_ms: dict[str, float]
    p99_ms: dict[str, float]
    cpu_ms: dict[str, float]  # per request, all of the path's processes
    errors: dict[str, int]


async def rate_steps(
    paths: dict[str, Callable[[], Awaitable[float]]],
    rates: list[float],
    step_s: float,
    pids: dict[str, dict[str, int]],
) -> list[RateRow]:
    rows = []
    for rate in rates:
        achieved, p50, p99, cpu, errors = {}, {}, {}, {}, {}
        for name, run in paths.items():
            before = cpu_snapshot(pids.get(name, {}))
            result = await open_loop(run, rate, step_s)
            spent = sum(cpu_snapshot(pids.get(name, {})).values()) - sum(before.values())
            achieved[name], errors[name] = result.achieved_rate, result.errors
            p50[name] = percentile(result.latencies, 50) * 1e3 if result.latencies else float("nan")
            p99[name] = percentile(result.latencies, 99) * 1e3 if result.latencies else float("nan")
            cpu[name] = spent / max(1, len(result.latencies)) * 1e3
            await asyncio.sleep(0.5)  # let queues drain between paths
        rows.append(RateRow(rate, achieved, p50, p99, cpu, errors))
        print(
            f"  rate {rate:g}/s: " + ", ".join(f"{n} p99 {p99[n]:.1f} ms" for n in paths),
            flush=True,
        )
        if all(p99[n] > 1000 for n in paths):
            break  # everything, the client-sent legs too, is saturated: the rig's limit
    return rows


async def profile(
    pid: int, run: Callable[[], Awaitable[float]], rate: float, seconds: float, out: Path
) -> Path | None:
    """py-spy the ext_proc while an open loop keeps it busy."""
    recording = asyncio.create_task(pyspy.record(pid, seconds, out))
    await asyncio.sleep(0.5)  # py-spy attaches
    load = await open_loop(run, rate, seconds)
    print(f"  profiled at {load.achieved_rate:.0f} req/s", flush=True)
    return await recording


async def envoy_counters(session: aiohttp.ClientSession, admin: str | None) -> list[str]:
    """Envoy's connection and request totals per listener / connection manager: shows whether
    the P legs reuse their connections to the prefill listener."""
    if admin is None:
        return []
    url = admin + "/stats?filter=(downstream_cx_total|downstream_rq_total|upstream_cx_total)$"
    async with session.get(url) as resp:
        text = await resp.text()
    return [line for line in text.splitlines() if line and not line.endswith(": 0")]


async def extproc_messages(session: aiohttp.ClientSession, admin: str | None) -> float | None:
    """gRPC messages per ext_proc stream on the ingress, both ways, from Envoy's totals."""
    if admin is None:
        return None
    async with session.get(admin + "/stats?filter=^http.ingress.ext_proc.") as resp:
        text = await resp.text()
    stats = {k: int(v) for k, _, v in (line.partition(": ") for line in text.splitlines()) if v}
    streams = stats.get("http.ingress.ext_proc.streams_started", 0)
    sent = stats.get("http.ingress.ext_proc.stream_msgs_sent", 0)
    received = stats.get("http.ingress.ext_proc.stream_msgs_received", 0)
    return (sent + received) / streams if streams else None


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def _through(session: aiohttp.ClientSession, url: str) -> Callable[[], Awaitable[float]]:
    return lambda: timed(session, url)


def versions() -> str:
    router = vllm_router_venv() / "bin" / "pip"
    shown = subprocess.run(
        [str(router), "show", "vllm-router"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    line = next((x for x in shown.splitlines() if x.startswith("Version:")), "Version: ?")
    return f"vllm-router {line.split(': ', 1)[1]}"


async def main(args: argparse.Namespace) -> None:
    engine_cpus, proxy_cpus = cpu_split(args.pin)
    router_bin = vllm_router_venv() / "bin" / "vllm-router"
    load_before, started = " ".join(f"{x:.2f}" for x in os.getloadavg()), time.time()
    async with contextlib.AsyncExitStack() as stack:
        engines = await stack.enter_async_context(
            running_engines("push", 1, 1, "sim-model", None, INSTANT, engine_cpus)
        )
        targets = {
            "pd-extproc": await stack.enter_async_context(
                running_extproc("push", engines, proxy_cpus, health=HEALTH)
            ),
            "vllm-router": await stack.enter_async_context(
                running_target("vllm-router", engines, router_bin, proxy_cpus)
            ),
        }
        if args.baseline is not None:  # the A side of an A/B: another version, same run
            PROXIES.insert(1, "pd-extproc (baseline)")
            targets[PROXIES[1]] = await stack.enter_async_context(
                running_extproc("push", engines, proxy_cpus, baseline=args.baseline, health=HEALTH)
            )
        if args.listener_leg:  # the P leg through Envoy's prefill listener, beside the default
            PROXIES.insert(1, LISTENER_LEG)
            targets[LISTENER_LEG] = await stack.enter_async_context(
                running_extproc(
                    "push", engines, proxy_cpus, dispatch={"prefill_leg": "listener"}, health=HEALTH
                )
            )
        for label, settings in args.variants:  # one lever each, beside the default
            PROXIES.append(f"pd-extproc ({label})")
            targets[PROXIES[-1]] = await stack.enter_async_context(
                running_extproc("push", engines, proxy_cpus, **({"health": HEALTH} | settings))
            )
        for n in args.workers:
            PROXIES.append(f"pd-extproc ×{n}")
            targets[PROXIES[-1]] = await stack.enter_async_context(
                running_extproc("push", engines, proxy_cpus, extproc={"workers": n}, health=HEALTH)
            )
        session = await stack.enter_async_context(
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30)
            )
        )
        p, d = engines.prefill[0], engines.decode[0]
        identity = await learn_identity(session, p)
        for mode in args.floors:
            PROXIES.append(FLOORS[mode])
            targets[FLOORS[mode]] = await stack.enter_async_context(
                running_floor(mode, engines, identity, BODY, proxy_cpus, FLOORS[mode])
            )
        paths: dict[str, Callable[[], Awaitable[float]]] = {
            "aggregated (client → D)": lambda: timed(session, d.url),
            "direct P/D": lambda: direct_pd(session, p, d, identity),
            **{name: _through(session, targets[name].url) for name in PROXIES},
        }
        pids = proxy_pids(targets)
        with pinned(engine_cpus):  # the client shares the engines' CPU, as in bench/run.py
            for run in paths.values():  # warm-up: connections, the router's first serial request
                for _ in range(30):
                    await run()
            print("sequential rounds", flush=True)
            ports = {name: _port(targets[name].url) for name in PROXIES}
            async with wire.wire_capture([p.port, d.port, *ports.values()]) as records:
                seq = await sequential(paths, engines, session, pids, args.requests, args.rounds)
            for name, st in seq.items():
                st.wire_skews = [
                    s for w in st.windows for s in wire.leg_skews(records, p.port, d.port, w)
                ]
                if name in ports:
                    st.to_prefill = [
                        s
                        for w in st.windows
                        for s in wire.dispatch_delays(records, ports[name], p.port, w)
                    ]
            print("open-loop rate steps", flush=True)
            loaded = {k: v for k, v in paths.items() if k != "aggregated (client → D)"}
            rows = await rate_steps(loaded, args.rates, args.step_s, pids)
            print("profile", flush=True)
            raw = await profile(
                pids["pd-extproc"]["ext_proc"],
                paths["pd-extproc"],
                args.profile_rate,
                args.profile_s,
                args.out / f"profile-extproc{args.tag}.txt",
            )
            counters = await envoy_counters(session, targets["pd-extproc"].envoy_admin)
            messages = {
                name: await extproc_messages(session, target.envoy_admin)
                for name, target in targets.items()
            }
    meta = {
        "load_before": load_before,
        "duration_s": time.time() - started,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "pinning": f"engines and client on CPU {sorted(engine_cpus)}, proxies on CPU "
        f"{sorted(proxy_cpus)}"
        if engine_cpus and proxy_cpus
        else "none",
        "versions": versions(),
        "envoy": counters,
        "messages": messages,
    }
    write_report(seq, rows, raw, args, meta)


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


def sequential_lines(seq: dict[str, PathStats]) -> list[str]:
    lines = ["| path | p50 | p90 | p99 | mean | requests |", "|---|---|---|---|---|---|"]
    for name, st in seq.items():
        lines.append(
            f"| {name} | {_ms(st.latencies, 50):.2f} | {_ms(st.latencies, 90):.2f} | "
            f"{_ms(st.latencies, 99):.2f} | {statistics.mean(st.latencies) * 1e3:.2f} | "
            f"{len(st.latencies)} |"
        )
    direct = seq["direct P/D"].latencies
    lines += [
        "",
        "| proxy | added p50 (ms) | added p99 (ms) | skew p50 (ms) | skew p99 (ms) | "
        "skew max (ms) | wire skew p50 (ms) | wire skew p99 (ms) | wire skew max (ms) | "
        "wire D − P p50 (ms) | client → P leg p50 (ms) | client → P leg p99 (ms) | "
        "CPU per request (ms) |",
        "|" + "---|" * 13,
    ]
    for name in ("direct P/D", *PROXIES):
        st = seq[name]
        added = (
            (
                f"{_ms(st.latencies, 50) - _ms(direct, 50):+.2f} | "
                f"{_ms(st.latencies, 99) - _ms(direct, 99):+.2f}"
            )
            if name in PROXIES
            else "— | —"
        )
        skew = (
            f"{_ms(st.skews, 50):.3f} | {_ms(st.skews, 99):.3f} | {max(st.skews) * 1e3:.3f}"
            if st.skews
            else "— | — | —"
        )
        apart = [abs(s) for s in st.wire_skews]
        wire_skew = (
            f"{_ms(apart, 50):.3f} | {_ms(apart, 99):.3f} | {max(apart) * 1e3:.3f} | "
            f"{_ms(st.wire_skews, 50):+.3f}"
            if apart
            else "— | — | — | —"
        )
        n = max(1, len(st.latencies))
        cpu = " + ".join(f"{k} {v / n * 1e3:.2f}" for k, v in st.cpu.items()) or "—"
        if len(st.cpu) > 1:
            cpu += f" = {sum(st.cpu.values()) / n * 1e3:.2f}"
        to_p = (
            f"{_ms(st.to_prefill, 50):.3f} | {_ms(st.to_prefill, 99):.3f}"
            if st.to_prefill
            else "— | —"
        )
        lines.append(f"| {name} | {added} | {skew} | {wire_skew} | {to_p} | {cpu} |")
    return lines


def _cpu_ms(st: PathStats) -> float:
    return sum(st.cpu.values()) / max(1, len(st.latencies)) * 1e3


def floor_lines(seq: dict[str, PathStats], messages: dict[str, float | None]) -> list[str]:
    """pd-extproc's CPU per request and client → P leg as ratios to each floor, and the aims."""
    floors = [name for name in FLOORS.values() if name in seq]
    if not floors:
        return ["No floor measured (`--floors ''`)."]
    ours = seq["pd-extproc"]
    figures = {
        "CPU per request, ext_proc + Envoy (ms)": _cpu_ms,
        "client → P leg p50 (ms)": lambda st: _ms(st.to_prefill, 50),
        "client → P leg p99 (ms)": lambda st: _ms(st.to_prefill, 99),
        "added latency p50 (ms)": lambda st: (
            _ms(st.latencies, 50) - _ms(seq["direct P/D"].latencies, 50)
        ),
    }
    head = ["figure", "pd-extproc", *(f"{f} | ratio" for f in floors)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * (2 + 2 * len(floors))]
    for label, figure in figures.items():
        mine = figure(ours)
        cells = [f"{figure(seq[f]):.3f} | {mine / figure(seq[f]):.2f}×" for f in floors]
        lines.append(f"| {label} | {mine:.3f} | " + " | ".join(cells) + " |")
    counts = [messages.get(n) for n in ("pd-extproc", *floors)]
    shown = ["—" if c is None else f"{c:.1f}" for c in counts]
    cells = [shown[0], *(x for c in shown[1:] for x in (c, ""))]
    lines.append("| ext_proc messages per request (both ways) | " + " | ".join(cells) + " |")
    same = floors[0]
    cpu, to_p = _cpu_ms(ours), _ms(ours.to_prefill, 50)
    checks = [
        (f"CPU per request ≤ {FLOOR_FACTOR:g} × {same}", cpu <= FLOOR_FACTOR * _cpu_ms(seq[same])),
        (
            f"client → P leg p50 ≤ {FLOOR_FACTOR:g} × {same}",
            to_p <= FLOOR_FACTOR * _ms(seq[same].to_prefill, 50),
        ),
        (f"client → P leg p50 ≤ {AIM_TO_PREFILL_MS:g} ms", to_p <= AIM_TO_PREFILL_MS),
        (f"CPU per request ≤ {AIM_CPU_MS:g} ms", cpu <= AIM_CPU_MS),
    ]
    lines += ["", *(f"- {label}: {'met' if ok else 'missed'}" for label, ok in checks)]
    return lines


def rate_lines(rows: list[RateRow]) -> list[str]:
    head = [
        "rate (req/s)",
        "direct P/D p99",
        *(f"{n} p99 (added)" for n in PROXIES),
        *(f"CPU/req {n}" for n in PROXIES),
        "sent/s (lowest path)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        base = row.p99_ms["direct P/D"]
        cells = [f"{row.p99_ms[n]:.2f} ({row.p99_ms[n] - base:+.2f})" for n in PROXIES]
        cpu = [f"{row.cpu_ms[n]:.2f}" for n in PROXIES]
        sent = min(row.achieved.values())
        lines.append(
            f"| {row.rate:g} | {base:.2f} | " + " | ".join([*cells, *cpu]) + f" | {sent:.0f} |"
        )
    lines += [
        "",
        *(
            f"- highest rate with p99 added < {ADDED_P99_LIMIT_MS:g} ms, {name}: "
            f"{_highest(rows, name)}"
            for name in PROXIES
        ),
    ]
    return lines


def _highest(rows: list[RateRow], name: str) -> str:
    """The last rate of the unbroken run of rates, from the lowest, under the limit."""
    ok = None
    for row in rows:
        if row.errors[name] or row.p99_ms[name] - row.p99_ms["direct P/D"] >= ADDED_P99_LIMIT_MS:
            break
        ok = row
    if ok is None:
        return f"none (already over at {rows[0].rate:g} req/s)"
    limited = (
        f" (client sent only {ok.achieved[name]:.0f}/s)"
        if ok.achieved[name] < 0.9 * ok.rate
        else ""
    )
    return f"{ok.rate:g} req/s{limited}"


def workers_option() -> str:
    """Whether `pd-extproc up` can run N ext_proc processes (the lead may add it)."""
    shown = subprocess.run(
        [sys.executable, "-m", "extproc", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    found = [line.strip() for line in shown.splitlines() if "worker" in line.lower()]
    return "; ".join(found) if found else ""


def profile_lines(raw: Path | None) -> list[str]:
    if raw is None:
        return ["py-spy is not installed (`.venv/bin/pip install py-spy`): no profile."]
    total, self_top, incl_top = pyspy.summarize(raw)
    lines = [
        f"{total} samples of the ext_proc's threads (raw stacks: `{raw.name}`).",
        "",
        "| top self cost | share |",
        "|---|---|",
    ]
    lines += [f"| `{frame}` | {count / total:.1%} |" for frame, count in self_top]
    lines += ["", "| top inclusive cost | share |", "|---|---|"]
    lines += [f"| `{frame}` | {count / total:.1%} |" for frame, count in incl_top]
    _, _, ours = pyspy.summarize(raw, top=20, only="extproc/")
    lines += ["", "| top inclusive cost in extproc/ | share |", "|---|---|"]
    lines += [f"| `{frame}` | {count / total:.1%} |" for frame, count in ours]
    return lines


def write_report(
    seq: dict[str, PathStats],
    rows: list[RateRow],
    raw: Path | None,
    args: argparse.Namespace,
    meta: dict,
) -> None:
    workers = workers_option()
    lines = [
        "# Proxy overhead and hot path: pd-extproc (push) vs vllm-router, instant vllmsim 1P1D",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {meta['versions']}; "
        f"{meta['duration_s']:.0f} s; load average before {meta['load_before']}, after "
        f"{meta['load_after']}; pinning: {meta['pinning']}. Engines: `{' '.join(INSTANT)}`.",
        "",
        "## Sequential requests (ms)",
        "",
        "Added latency = proxy − direct P/D (the client sending both legs itself) at the same "
        "percentile. Skew = |D arrival − P arrival| on the engines' clocks (it includes the "
        "engines' own scheduling: P and D share a CPU). Wire skew = the same difference between "
        "the kernel timestamps of each leg's first TCP segment on loopback (`bench/wire.py`): "
        "where the proxy let the legs go, the dispatch skew proper; D − P > 0 means P left "
        "first. Client → P leg = from the client's request reaching the proxy's port to the P "
        "leg leaving for P, on the same kernel clock: the proxy's share of TTFT. CPU = "
        "user+system of the proxy's processes over the measured requests.",
        "",
        *sequential_lines(seq),
        "",
        "## pd-extproc against the floor",
        "",
        *floor_lines(seq, meta["messages"]),
        "",
        f"## Open-loop rate steps ({args.step_s:g} s per rate and path, latencies in ms)",
        "",
        *rate_lines(rows),
        "",
        "## N ext_proc processes behind Envoy",
        "",
        (
            f"Measured above as `pd-extproc ×N` (config `extproc.workers: N`, Envoy spreads "
            f"streams by least requests); N = 1 is `pd-extproc`. With pinning all workers share "
            f"the proxies' one CPU. `up --help` workers flag: "
            f"{workers or 'none (config key only)'}."
            if args.workers
            else "Not measured (`--workers ''`)."
        ),
        "",
        f"## py-spy profile of the ext_proc at {args.profile_rate:g} req/s open loop",
        "",
        *profile_lines(raw),
        "",
        "## Envoy totals of the pd-extproc path at the end (all phases)",
        "",
        "```",
        *meta["envoy"],
        "```",
        "",
    ]
    (args.out / f"hotpath{args.tag}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="sequential, per path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rates", default="20,40,60,80,100,125,150")
    parser.add_argument("--step-s", type=float, default=10.0, help="long enough for a p99")
    parser.add_argument("--profile-rate", type=float, default=50.0)
    parser.add_argument("--profile-s", type=float, default=15.0)
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--tag", default="", help="suffix of the output files, e.g. -nopin")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="also measure the extproc package found in this directory (e.g. "
        "`git archive BASE extproc | tar -x -C DIR`): before/after in one run",
    )
    parser.add_argument(
        "--no-listener-leg",
        dest="listener_leg",
        action="store_false",
        help="do not measure pd-extproc with dispatch.prefill_leg: listener",
    )
    parser.add_argument(
        "--workers",
        default="2",
        help="also measure pd-extproc with extproc.workers = each N (comma list; '' for none)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="also measure pd-extproc with these config sections merged in, e.g. "
        """'no access log={"access_log": {"enabled": false}}' (repeatable)""",
    )
    parser.add_argument(
        "--floors",
        default="same,fewest",
        help="the do-nothing ext_procs to measure beside them (comma list of "
        f"{', '.join(FLOORS)}; '' for none)",
    )
    parser.add_argument(
        "--kv-approx",
        action="store_true",
        help="also measure kv_cache with no KV events or tokenizer, with and without its "
        "estimate of what each engine was sent (kv_approximate)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.workers = [int(n) for n in args.workers.split(",") if n]
    args.floors = [mode for mode in args.floors.split(",") if mode]
    args.variants = []
    for given in args.variant:
        label, _, settings = given.partition("=")
        try:
            parsed = orjson.loads(settings)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            parser.error(f"--variant {given!r}: expected LABEL={{config sections as JSON}}")
        args.variants.append((label, parsed))
    if args.kv_approx:
        args.variants += [
            (label, {role: {"policy": "kv_cache", "kv_approximate": on} for role in ROLES})
            for label, on in KV_APPROX
        ]
    unknown = set(args.floors) - set(FLOORS)
    if unknown:
        parser.error(f"--floors: unknown {', '.join(sorted(unknown))} (known: {', '.join(FLOORS)})")
    args.baseline = args.baseline.resolve() if args.baseline is not None else None
    args.out.mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    run_bench(main(parse_args()))
