#!/usr/bin/env python3
"""Long prompts: 200 KB prompts at rising concurrency through pd-extproc and vllm-router.

One 1P1D push topology of instant vllmsim engines (bench/hotpath.py's). The prompt is 200 KB
of bytes but few tokens (`prompt`): the simulator's per-token work (tokenizing, hashing and
pushing ~40k tokens' blocks in Python) would cap both proxies at the engines' few requests/s
on this machine, so what grows with the prompt here is what the proxies do with its bytes.
Per concurrency C, each path runs a closed loop of C clients for `--step-s` seconds: streamed
completions of a prompt made unique by its first word (no prefix-cache hit), 4 output tokens.

  direct P/D    the client sends both legs itself (the same bodies the proxies build)
  pd-extproc    push dispatch, its defaults
  vllm-router   PD mode

Per path and C: TTFT (request sent → first streamed chunk) p50/p99 and added TTFT (the path
− direct P/D at the same percentile), completed requests/s (the highest C's is the ceiling),
errors, and for pd-extproc the ext_proc's and Envoy's peak RSS while the step ran.

    python bench/long_prompts.py [--prompt-kb 200] [--concurrency 20,50,100,150] [--step-s 6]

`--stalls`: instead, what one long prompt costs the ext_proc's event loop, per prompt size
(`--stall-mb`), without and with a tokenizer (`tokenizer:` and kv_events set; with
`--baseline DIR`, that version with the tokenizer too). Per prompt: the stall (the longest
answer of the ext_proc's `/live`, asked every 20 ms while the request is in) and the ext_proc's
CPU seconds. The tokenizer is word-level, with one 2,000-character token in its vocabulary so
that the engines' context length (8,192 tokens) bounds nothing below 16 M characters: every
prompt is tokenized, the worst case. Writes long-prompts-stalls.md (and .png with matplotlib).

    python bench/long_prompts.py --stalls [--stall-mb 1,5,10,16] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import pyspy
from bench.engines import INSTANT, Engines, running_engines
from bench.openloop import percentile
from bench.overhead import learn_identity
from bench.procs import child_pids, pinned, run_bench
from bench.run import cpu_split
from bench.targets import Target, running_extproc, running_target
from extproc.testing import ephemeral_config, running_sidecar
from scripts.cached_envs import vllm_router_venv

RESULTS = Path(__file__).resolve().parent / "results"
LONG = INSTANT
PATHS = ["direct P/D", "pd-extproc", "vllm-router"]  # with --baseline, its pd-extproc too
BASELINE = "pd-extproc (baseline)"
OUTPUT_TOKENS = 4
TTFT_FACTOR = 2.0  # the check: pd-extproc's added TTFT p99 at the highest C ≤ 2 × the router's


def prompt(kb: int) -> str:
    """`kb` KB: a fresh first word (no two requests share a prefix), then words each followed
    by 1 KB of spaces. The simulator counts no token for whitespace, so its prompt is ~200
    tokens and the engines stay instant, while the proxies parse, copy and send every byte
    (one byte per space in JSON, as a letter)."""
    gap = " " * 1023
    return uuid.uuid4().hex + "".join(f"{gap}w{i % 10}" for i in range(kb))


@dataclass
class Step:
    ttfts: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    rss_peak_mb: dict[str, float] = field(default_factory=dict)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def first_chunk(response: aiohttp.ClientResponse, started: float) -> float:
    """Seconds from `started` to the first streamed data chunk; the rest is read (and checked)."""
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}")
    ttft = None
    async for line in response.content:
        if ttft is None and line.startswith(b"data: "):
            ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("no streamed chunk")
    return ttft


def client_body(kb: int) -> dict:
    return {"model": "sim-model", "prompt": prompt(kb), "max_tokens": OUTPUT_TOKENS}


def direct_bodies(kb: int, identity: dict) -> tuple[str, bytes, bytes]:
    """One request of direct P/D: its id, and the P and D bodies the proxies would build."""
    client = client_body(kb)
    rid, xfer = str(uuid.uuid4()), f"xfer-{uuid.uuid4()}"
    p = client | {
        "max_tokens": 1,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": xfer,
        },
    }
    d = client | {
        "stream": True,
        "kv_transfer_params": identity | {"remote_request_id": rid, "transfer_id": xfer},
    }
    return rid, orjson.dumps(p), orjson.dumps(d)


def through(session: aiohttp.ClientSession, url: str, kb: int) -> Callable[[], Awaitable[float]]:
    async def run() -> float:
        rid, body = str(uuid.uuid4()), orjson.dumps(client_body(kb) | {"stream": True})
        headers = {"content-type": "application/json", "x-request-id": rid}
        started = time.perf_counter()
        async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
            return await first_chunk(resp, started)

    return run


def direct(
    session: aiohttp.ClientSession, p_url: str, d_url: str, kb: int, identity: dict
) -> Callable[[], Awaitable[float]]:
    async def prefill(body: bytes, headers: dict[str, str]) -> None:
        async with session.post(p_url + "/v1/completions", data=body, headers=headers) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"P: HTTP {resp.status}")

    async def run() -> float:
        rid, p_body, d_body = direct_bodies(kb, identity)
        headers = {"content-type": "application/json", "x-request-id": rid}
        started = time.perf_counter()
        leg = asyncio.create_task(prefill(p_body, headers))
        try:
            async with session.post(
                d_url + "/v1/completions", data=d_body, headers=headers
            ) as resp:
                ttft = await first_chunk(resp, started)
            await leg
        finally:
            leg.cancel()
        return ttft

    return run


def sidecar_pids(target: Target) -> dict[str, int]:
    """`pd-extproc up`'s ext_proc and its Envoy (its child)."""
    assert target.pid is not None
    envoy = child_pids(target.pid)
    return {"ext_proc": target.pid, **({"envoy": envoy[0]} if envoy else {})}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def watch_rss(pids: dict[str, int], peaks: dict[str, float], stop: asyncio.Event) -> None:
    while True:
        for name, pid in pids.items():
            with contextlib.suppress(OSError):
                peaks[name] = max(peaks.get(name, 0.0), rss_mb(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)
            return


async def closed_loop(
    run: Callable[[], Awaitable[float]], concurrency: int, seconds: float, pids: dict[str, int]
) -> Step:
    """`concurrency` clients, each sending its next request when its last one ended, until
    `seconds` have passed; the requests in flight then are finished and counted."""
    step, stop = Step(), asyncio.Event()
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < deadline:
            try:
                step.ttfts.append(await asyncio.wait_for(run(), 60))
            except (aiohttp.ClientError, RuntimeError, TimeoutError) as error:
                step.error(str(error) or type(error).__name__)

    watcher = asyncio.create_task(watch_rss(pids, step.rss_peak_mb, stop))
    started = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        stop.set()
        await watcher
    step.elapsed_s = time.perf_counter() - started
    return step


async def main(args: argparse.Namespace) -> None:
    engine_cpus, proxy_cpus = cpu_split(args.pin)
    router_bin = vllm_router_venv() / "bin" / "vllm-router"
    load_before, began = " ".join(f"{x:.2f}" for x in os.getloadavg()), time.time()
    results: dict[int, dict[str, Step]] = {}
    profile: Path | None = None
    async with contextlib.AsyncExitStack() as stack:
        engines = await stack.enter_async_context(
            running_engines("push", 1, 1, "sim-model", None, LONG, engine_cpus)
        )
        ours = await stack.enter_async_context(
            running_target("push", engines, router_bin, proxy_cpus)
        )
        router = await stack.enter_async_context(
            running_target("vllm-router", engines, router_bin, proxy_cpus)
        )
        session = await stack.enter_async_context(
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=90)
            )
        )
        p, d = engines.prefill[0], engines.decode[0]
        identity = await learn_identity(session, p)
        paths = {"direct P/D": direct(session, p.url, d.url, args.prompt_kb, identity)}
        watched: dict[str, dict[str, int]] = {}
        if args.baseline is not None:  # the A side of an A/B: another version, same run
            base = await stack.enter_async_context(
                running_extproc("push", engines, proxy_cpus, baseline=args.baseline)
            )
            PATHS.insert(1, BASELINE)
            paths[BASELINE] = through(session, base.url, args.prompt_kb)
            watched[BASELINE] = sidecar_pids(base)
        paths["pd-extproc"] = through(session, ours.url, args.prompt_kb)
        paths["vllm-router"] = through(session, router.url, args.prompt_kb)
        watched["pd-extproc"] = sidecar_pids(ours)
        assert router.pid is not None
        watched["vllm-router"] = {"vllm-router": router.pid}
        with pinned(engine_cpus):
            for run in paths.values():  # warm-up: connections, the router's first request
                await closed_loop(run, 4, 1.0, {})
            for concurrency in args.concurrency:
                results[concurrency] = {}
                for name, run in paths.items():
                    recording = None
                    if name == "pd-extproc" and concurrency == args.profile_c:
                        out = args.out / f"profile-extproc-long{args.tag}.txt"
                        recording = asyncio.create_task(
                            pyspy.record(watched[name]["ext_proc"], args.step_s, out)
                        )
                    step = await closed_loop(run, concurrency, args.step_s, watched.get(name, {}))
                    if recording is not None:
                        profile = await recording
                    results[concurrency][name] = step
                    print(
                        f"  C={concurrency} {name}: {len(step.ttfts)} ok, "
                        f"{sum(step.errors.values())} errors, "
                        f"TTFT p99 {_ms(step.ttfts, 99):.0f} ms",
                        flush=True,
                    )
                    await asyncio.sleep(1.0)  # the engines drain between paths
    meta = {
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "duration_s": time.time() - began,
        "pinning": f"engines and client on CPU {sorted(engine_cpus)}, proxies on CPU "
        f"{sorted(proxy_cpus)}"
        if engine_cpus and proxy_cpus
        else "none",
    }
    write_report(results, args, meta, profile)


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3 if values else float("nan")


def report_lines(results: dict[int, dict[str, Step]]) -> list[str]:
    lines = [
        "| C | path | requests | errors | req/s | TTFT p50 | TTFT p99 | added p50 | added p99 "
        "| peak RSS (MB) |",
        "|" + "---|" * 10,
    ]
    for concurrency, steps in results.items():
        base = steps["direct P/D"].ttfts
        for name, step in steps.items():
            added = (
                f"{_ms(step.ttfts, 50) - _ms(base, 50):+.1f} | "
                f"{_ms(step.ttfts, 99) - _ms(base, 99):+.1f}"
                if name != "direct P/D"
                else "— | —"
            )
            rss = ", ".join(f"{k} {v:.0f}" for k, v in step.rss_peak_mb.items()) or "—"
            errors = sum(step.errors.values())
            lines.append(
                f"| {concurrency} | {name} | {len(step.ttfts)} | {errors} | "
                f"{len(step.ttfts) / step.elapsed_s:.1f} | {_ms(step.ttfts, 50):.1f} | "
                f"{_ms(step.ttfts, 99):.1f} | {added} | {rss} |"
            )
    return lines


def check_lines(results: dict[int, dict[str, Step]]) -> list[str]:
    top = max(results)
    steps = results[top]
    base = _ms(steps["direct P/D"].ttfts, 99)
    ours = _ms(steps["pd-extproc"].ttfts, 99) - base
    theirs = _ms(steps["vllm-router"].ttfts, 99) - base
    errors = {name: sum(sum(s[name].errors.values()) for s in results.values()) for name in PATHS}
    kinds = sorted({e for s in results.values() for st in s.values() for e in st.errors})
    ceiling = {
        name: max(len(s[name].ttfts) / s[name].elapsed_s for s in results.values())
        for name in PATHS
    }
    if BASELINE in steps:
        before = _ms(steps[BASELINE].ttfts, 99) - base
        theirs_note = f", {BASELINE} {before:+.1f} ms"
    else:
        theirs_note = ""
    lines = [
        f"- added TTFT p99 at C = {top}: pd-extproc {ours:+.1f} ms, vllm-router {theirs:+.1f} ms"
        f"{theirs_note} "
        f"(check: ≤ {TTFT_FACTOR:g} × the router's: "
        f"{'met' if ours <= TTFT_FACTOR * max(theirs, 0.0) else 'missed'})",
        "- throughput ceiling (highest req/s over the steps): "
        + ", ".join(f"{n} {v:.1f}" for n, v in ceiling.items()),
        "- errors: " + ", ".join(f"{n} {v}" for n, v in errors.items()),
    ]
    if kinds:
        lines.append("- error kinds: " + "; ".join(kinds[:8]))
    peaks = [s["pd-extproc"].rss_peak_mb.get("ext_proc", 0.0) for s in results.values()]
    lines.append("- ext_proc peak RSS per step (MB): " + ", ".join(f"{p:.0f}" for p in peaks))
    return lines


def profile_lines(raw: Path | None, concurrency: int) -> list[str]:
    if raw is None:
        return []
    total, self_top, _ = pyspy.summarize(raw, top=12)
    _, _, ours = pyspy.summarize(raw, top=12, only="extproc/")
    lines = [
        f"## py-spy profile of the ext_proc at C = {concurrency}",
        "",
        f"{total} samples (raw stacks: `{raw.name}`).",
        "",
        "| top self cost | share |",
        "|---|---|",
        *(f"| `{frame}` | {count / total:.1%} |" for frame, count in self_top),
        "",
        "| top inclusive cost in extproc/ | share |",
        "|---|---|",
        *(f"| `{frame}` | {count / total:.1%} |" for frame, count in ours),
        "",
    ]
    return lines


def write_report(
    results: dict[int, dict[str, Step]],
    args: argparse.Namespace,
    meta: dict,
    profile: Path | None,
) -> None:
    lines = [
        f"# Long prompts: {args.prompt_kb} KB prompts, instant vllmsim 1P1D, closed loop",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {meta['duration_s']:.0f} s; "
        f"load average before {meta['load_before']}, after {meta['load_after']}; pinning: "
        f"{meta['pinning']}; {args.step_s:g} s per step and path, {OUTPUT_TOKENS} output "
        f"tokens, streamed. Engines: `{' '.join(LONG)}`.",
        "",
        "TTFT = the client sending the request → the first streamed chunk; added = the path − "
        "direct P/D (the client sending both legs itself) at the same percentile (ms). Peak "
        "RSS sampled every 50 ms during the step.",
        "",
        *report_lines(results),
        "",
        *check_lines(results),
        "",
        *profile_lines(profile, args.profile_c),
    ]
    out = args.out / f"long-prompts{args.tag}.md"
    out.write_text("\n".join(lines))
    print("\n".join(lines))


# -- --stalls ----------------------------------------------------------------------------------

STALL_WORDS = [f"w{i}" for i in range(400)]


def stall_tokenizer(folder: Path) -> Path:
    """The word-level tokenizer of `--stalls` (see the docstring), written to `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    special = ["<s>", "</s>", "<unk>", "x" * 2000]
    vocab = {w: i for i, w in enumerate([*special, *STALL_WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stall(session: aiohttp.ClientSession, target: Target, mb: int) -> dict[str, float]:
    """Send one `mb` MB prompt of words; the longest /live answer meanwhile, the ext_proc's CPU."""
    assert target.pid is not None and target.metrics is not None
    count = mb * 1_000_000 // 5
    text = " ".join(STALL_WORDS[i % len(STALL_WORDS)] for i in range(count))
    body = orjson.dumps({"model": "sim-model", "prompt": text, "max_tokens": 1})
    cpu_before = cpu_s(target.pid)

    async def request() -> int:
        async with session.post(
            target.url + "/v1/completions",
            data=body,
            headers={"content-type": "application/json"},
        ) as response:
            await response.read()
            return response.status

    work, longest = asyncio.create_task(request()), 0.0
    while not work.done():
        started = time.perf_counter()
        async with session.get(target.metrics + "/live") as response:
            await response.read()
        longest = max(longest, time.perf_counter() - started)
        await asyncio.wait([work], timeout=0.02)
    status = await work
    return {"stall_s": longest, "cpu_s": cpu_s(target.pid) - cpu_before, "status": status}


async def stalls(args: argparse.Namespace) -> None:
    import tempfile

    began = time.time()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-stalls-") as tmp:
        model = stall_tokenizer(Path(tmp))
        sides: list[tuple[str, Path | None, str | None]] = [
            ("no tokenizer", None, None),
            ("tokenizer", None, str(model)),
        ]
        if args.baseline is not None:
            sides.insert(1, ("tokenizer, baseline", args.baseline, str(model)))
        async with contextlib.AsyncExitStack() as stack:
            engines = await stack.enter_async_context(
                running_engines("push", 1, 1, "sim-model", None, LONG)
            )
            session = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180))
            )
            for name, baseline, tokenizer in sides:
                running = running_stall_sidecar(engines, tokenizer, baseline)
                async with running as target:
                    await asyncio.sleep(2.0)  # the probe learns the context length
                    results[name] = {}
                    for mb in args.stall_mb:
                        results[name][mb] = row = await one_stall(session, target, mb)
                        print(f"  {name} {mb} MB: {row}", flush=True)
    lines = [
        "# Long prompts: the ext_proc's event-loop stall and CPU per prompt, with a tokenizer",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {time.time() - began:.0f} s; "
        f"load average before {load_before}, after "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; one request at a time, instant "
        "vllmsim 1P1D (the engines refuse the prompts, 400: longer than their context). "
        "Stall = the longest `/live` answer while the request was in; CPU = the ext_proc's; "
        "HTTP = the client's answer.",
        "",
        "| MB | " + " | ".join(f"{n}: stall s | CPU s | HTTP" for n in results) + " |",
        "|---|" + "---|---|---|" * len(results),
    ]
    for mb in args.stall_mb:
        cells = [
            f"{r[mb]['stall_s']:.3f} | {r[mb]['cpu_s']:.2f} | {r[mb]['status']:.0f}"
            for r in results.values()
        ]
        lines.append(f"| {mb} | " + " | ".join(cells) + " |")
    out = args.out / f"long-prompts-stalls{args.tag}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    stall_plot(results, args.stall_mb, out.with_suffix(".png"))


@contextlib.asynccontextmanager
async def running_stall_sidecar(
    engines: Engines, tokenizer: str | None, baseline: Path | None
) -> AsyncIterator[Target]:
    """pd-extproc (push) taking 16 MiB bodies; with `tokenizer`, KV-routed (kv_events on both
    pools); `baseline`: a directory holding another version's `extproc` package."""
    config = ephemeral_config(
        engines.addresses("prefill"),
        engines.addresses("decode"),
        dispatch={"mode": "push"},
        limits={"max_body_bytes": 16 * 1024 * 1024},
    )
    if tokenizer is not None:
        config |= {"tokenizer": tokenizer}
        config["prefill"]["kv_events"] = config["decode"]["kv_events"] = {}
    env = None if baseline is None else {"PYTHONPATH": str(baseline), "PYTHONSAFEPATH": "1"}
    async with running_sidecar(config, log_level="WARNING", env=env) as sidecar:
        yield Target("pd-extproc", sidecar.url, sidecar.pid, sidecar.metrics)


def stall_plot(
    results: dict[str, dict[int, dict[str, float]]], sizes: list[int], out: Path
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, rows in results.items():
        axis.plot(sizes, [rows[mb]["stall_s"] for mb in sizes], marker="o", label=name)
    axis.set_xlabel("prompt (MB)")
    axis.set_ylabel("longest /live answer (s)")
    axis.legend()
    figure.savefig(out, dpi=120, bbox_inches="tight")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-kb", type=int, default=200)
    parser.add_argument("--concurrency", default="20,50,100,150")
    parser.add_argument("--step-s", type=float, default=6.0)
    parser.add_argument(
        "--profile-c",
        type=int,
        default=0,
        help="py-spy pd-extproc's ext_proc at this concurrency (0: no profile; it slows it)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="also measure the extproc package found in this directory (e.g. "
        "`git archive BASE extproc | tar -x -C DIR`): before/after in one run",
    )
    parser.add_argument("--stalls", action="store_true", help="the stall table (see above)")
    parser.add_argument("--stall-mb", default="1,5,10,16")
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.stall_mb = [int(m) for m in args.stall_mb.split(",")]
    args.baseline = args.baseline.resolve() if args.baseline is not None else None
    args.out.mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    arguments = parse_args()
    run_bench(stalls(arguments) if arguments.stalls else main(arguments))
