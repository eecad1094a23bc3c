"""Small requests beside eight concurrent 10 MB prompts: their latency, and where the ext_proc's
event loop spends its time (issue 35's check: small requests' p99 under 0.5 s).

One instant vllmsim 1P1D (push); four clients (a process of their own) send 2 KB completions in
a closed loop while eight 10 MB prompts (spaces between two words: the engines skip them at
once) go through together.
`--cprofile PATH` runs the ext_proc under cProfile (its main thread: the event loop) and
prints the functions with the most own time; `--cprofile-engines PATH` each engine. `--pin`
gives the sidecar (Envoy, the ext_proc) CPU 1 and the engines and clients CPU 0.

    python bench/big_bodies.py [--tokenizer] [--rounds 3] [--quiet-s 2] [--cprofile /tmp/p.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engines import INSTANT, running_engines
from bench.procs import child_pids, pinned
from extproc.testing import ephemeral_config, running_sidecar

MB = 1_000_000
# `--pin`: the sidecar (Envoy, the ext_proc) on a core of its own, as on a machine apart from
# the engines; the engines and the clients share the other.
SIDECAR_CPUS, ENGINE_CPUS = {1}, {0}
WORDS = [f"w{i}" for i in range(400)]
# Starts cProfile in the ext_proc's process (a `sitecustomize` on its PYTHONPATH) and writes its
# stats when the process exits.
_HOOK = """
import atexit, cProfile, os
_profile = cProfile.Profile()
_profile.enable()
atexit.register(lambda: (_profile.disable(), _profile.dump_stats(
    os.environ["PD_CPROFILE"] + "." + str(os.getpid()))))
"""


def stall_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer knowing WORDS (as `long_prompts.py --stalls`'s)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def big_body() -> bytes:
    prompt = "w1" + " " * (10 * MB - 4) + "w2"
    return orjson.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 1})


def small_body() -> bytes:
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(400))  # about 2 KB
    return orjson.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 1})


async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    started = time.perf_counter()
    async with session.post(
        url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    ) as response:
        await response.read()
        assert response.status < 500, response.status
    return time.perf_counter() - started


async def small_clients(url: str) -> None:
    """`--small-client`: four clients sending small requests in a closed loop until standard
    input closes, then their latencies as JSON on standard output. A process of its own, as
    another client is: in the big bodies' process, its requests waited on that loop too."""
    small, latencies = small_body(), []
    done = asyncio.Event()
    stdin = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    async def client(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            latencies.append(await post(session, url, small))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(4)]
        print("ready", flush=True)
        await stdin.read()
        done.set()
        await asyncio.gather(*clients)
    print(orjson.dumps(latencies).decode(), flush=True)


async def one_round(url: str) -> tuple[list[float], list[float]]:
    """The small requests' latencies (another process's clients), and the big ones', for one
    burst of eight."""
    big = big_body()
    other = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--small-client",
        url,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert other.stdin is not None and other.stdout is not None
    try:
        assert await asyncio.wait_for(other.stdout.readline(), 30) == b"ready\n"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            bigs = await asyncio.gather(*(post(session, url, big) for _ in range(8)))
        other.stdin.close()
        smalls = orjson.loads(await asyncio.wait_for(other.stdout.read(), 60))
    finally:
        if other.returncode is None:
            other.kill()
        await other.wait()
    return smalls, list(bigs)


def cpu_s(pid: int, system_only: bool = False) -> float:
    """The process's CPU time so far (only the kernel's part: `system_only`, page faults among
    it)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[12]) if system_only else int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def page_faults(pid: int) -> int:
    """The process's minor page faults so far: a fresh page of the heap costs one each."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def box_cpu_s() -> float:
    """Every core's busy time so far (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7))
    return busy / os.sysconf("SC_CLK_TCK")


async def longest_answer(url: str, done: asyncio.Event) -> float:
    """The longest answer of `url` until `done`: the ext_proc's `/live` (served on its event
    loop), an engine's `/health` (on its own loop, which parses the bodies it is sent)."""
    longest = 0.0
    async with aiohttp.ClientSession() as session:
        while not done.is_set():
            started = time.perf_counter()
            async with session.get(url) as response:
                await response.read()
            longest = max(longest, time.perf_counter() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.02)
    return longest


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


async def main(args: argparse.Namespace) -> None:
    env: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-big-") as tmp:
        engine_env: dict[str, str] = {}
        if args.cprofile is not None or args.cprofile_engines is not None:
            (Path(tmp) / "sitecustomize.py").write_text(_HOOK)
        if args.cprofile is not None:
            env = {"PYTHONPATH": tmp, "PD_CPROFILE": str(args.cprofile)}
        if args.cprofile_engines is not None:
            engine_env = {"PYTHONPATH": tmp, "PD_CPROFILE": str(args.cprofile_engines)}
        if args.baseline is not None:  # another version's `extproc` package
            env |= {"PYTHONPATH": str(args.baseline), "PYTHONSAFEPATH": "1"}
        if args.glibc_tunables:  # e.g. glibc.malloc.hugetlb=1: the heap in huge pages
            env["GLIBC_TUNABLES"] = args.glibc_tunables
        if args.slow_callbacks:
            env["PYTHONASYNCIODEBUG"] = "1"  # logs each loop step over 0.1 s
        async with contextlib.AsyncExitStack() as stack:
            engines = await stack.enter_async_context(
                running_engines(
                    "push",
                    1,
                    1,
                    "sim-model",
                    None,
                    INSTANT,
                    ENGINE_CPUS if args.pin else None,
                    env=engine_env,
                )
            )
            config = ephemeral_config(
                engines.addresses("prefill"),
                engines.addresses("decode"),
                dispatch={"mode": "push"},
                limits={"max_body_bytes": 16 * 1024 * 1024, "max_body_bytes_in_flight": 256 << 20},
            )
            if args.workers is not None:
                config.setdefault("extproc", {})["workers"] = args.workers
            if args.tokenizer:
                config["tokenizer"] = str(stall_tokenizer(Path(tmp)))
                config["prefill"]["kv_events"] = config["decode"]["kv_events"] = {}
            with pinned(SIDECAR_CPUS if args.pin else None):
                sidecar = await stack.enter_async_context(
                    running_sidecar(config, log_level="WARNING", env=env)
                )
            if args.pin:  # the clients (this process and the small one it starts) too
                os.sched_setaffinity(0, ENGINE_CPUS)
            await asyncio.sleep(2.0)  # the probe
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            envoy = child_pids(sidecar.pid)
            engine_pids = [pid for pid in child_pids(os.getpid()) if pid != sidecar.pid]
            for n in range(args.rounds):
                if n:  # past a second of quiet the heap is trimmed: the next round is cold
                    await asyncio.sleep(args.quiet_s)
                faults = page_faults(sidecar.pid)
                cpu, done = cpu_s(sidecar.pid), asyncio.Event()
                system = cpu_s(sidecar.pid, system_only=True)
                envoy_cpu, box, wall = sum(map(cpu_s, envoy)), box_cpu_s(), time.perf_counter()
                engines_cpu, client_cpu = sum(map(cpu_s, engine_pids)), cpu_s(os.getpid())
                urls = [sidecar.metrics + "/live"]
                urls += [
                    f"http://{a}/health"
                    for r in ("prefill", "decode")
                    for a in engines.addresses(r)
                ]
                watchers = [asyncio.create_task(longest_answer(url, done)) for url in urls]
                try:
                    smalls, bigs = await one_round(sidecar.url)
                finally:
                    done.set()
                    stall, *engine_stalls = await asyncio.gather(*watchers)
                print(
                    f"round {n + 1}: {len(smalls)} small, p50 {quantile(smalls, 0.5):.3f} s, "
                    f"p99 {quantile(smalls, 0.99):.3f} s, max {max(smalls):.3f} s; "
                    f"8 x 10 MB in {max(bigs):.2f} s; ext_proc CPU "
                    f"{cpu_s(sidecar.pid) - cpu:.2f} s (system "
                    f"{cpu_s(sidecar.pid, system_only=True) - system:.2f} s, "
                    f"{page_faults(sidecar.pid) - faults} page faults), Envoy "
                    f"{sum(map(cpu_s, envoy)) - envoy_cpu:.2f} s, the engines "
                    f"{sum(map(cpu_s, engine_pids)) - engines_cpu:.2f} s, this client "
                    f"{cpu_s(os.getpid()) - client_cpu:.2f} s, the machine "
                    f"{box_cpu_s() - box:.2f} s in {time.perf_counter() - wall:.2f} s; "
                    f"longest /live {stall:.3f} s, the engines' /health "
                    f"{', '.join(f'{s:.3f}' for s in engine_stalls)} s; "
                    f"ext_proc RSS {rss_mib(sidecar.pid)} MiB; "
                    f"load before {load}",
                    flush=True,
                )
            await asyncio.sleep(3.0)  # the memory of the bodies given back meanwhile
            print(f"ext_proc RSS 3 s after the last round: {rss_mib(sidecar.pid)} MiB", flush=True)
            if args.slow_callbacks:
                slow = [line for line in sidecar.log_text().splitlines() if " took " in line]
                print("\n".join(slow[-40:]))
    for prefix in (p for p in (args.cprofile, args.cprofile_engines) if p is not None):
        for path in glob.glob(f"{prefix}.*"):
            print(f"-- {path}")
            pstats.Stats(path).sort_stats("tottime").print_stats(25)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quiet-s", type=float, default=0.0, help="pause between rounds")
    parser.add_argument("--cprofile", type=Path, default=None)
    parser.add_argument("--cprofile-engines", type=Path, default=None, help="the engines, each")
    parser.add_argument("--slow-callbacks", action="store_true")
    parser.add_argument("--baseline", type=Path, default=None, help="a dir holding extproc/")
    parser.add_argument("--workers", type=int, default=None, help="extproc.workers")
    parser.add_argument("--pin", action="store_true", help="the sidecar on CPU 1, the rest on 0")
    parser.add_argument("--glibc-tunables", default="", help="the ext_proc's GLIBC_TUNABLES")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    asyncio.run(
        small_clients(arguments.small_client) if arguments.small_client else main(arguments)
    )
