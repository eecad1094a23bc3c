"""The configurations compared, each started on given engines and yielding one base URL.

direct        the client talks to the first decode engine, which prefills itself
vllm-router   vllm-router 0.1.17 in PD mode (it turns on parallel push by itself)
pull          pd-extproc, NIXL pull engines, serial dispatch
serial-push   pd-extproc, push engines, P then D (the baseline of PR #187)
push          pd-extproc, push engines, both legs at once
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import yaml

from bench.engines import Engines
from bench.procs import free_port, pinned, running_process, wait_http_ok
from extproc.testing import ephemeral_config, running_sidecar

FLOOR = Path(__file__).resolve().parent / "floor_extproc.py"

CONFIGS = ("direct", "vllm-router", "pull", "serial-push", "push")
# The engine kind each configuration runs on.
ENGINE_KIND = {
    "direct": "push",
    "vllm-router": "push",
    "pull": "pull",
    "serial-push": "push",
    "push": "push",
}
EXTPROC_MODES = {"pull": "pull", "serial-push": "serial_push", "push": "push"}


@dataclass(frozen=True)
class Target:
    name: str
    url: str  # base URL of the OpenAI API
    pid: int | None  # the proxy process whose CPU we account (None: direct)
    metrics: str | None = None
    envoy_admin: str | None = None


@contextlib.asynccontextmanager
async def running_router(
    engines: Engines,
    router_bin: Path,
    cpus: set[int] | None = None,
    policy: str = "round_robin",
    name: str = "vllm-router",
    extra: Sequence[str] = (),
) -> AsyncIterator[Target]:
    """`extra`: more of the router's flags (a prefill policy, KV event sources)."""
    port = free_port()
    argv = [
        str(router_bin),
        "--vllm-pd-disaggregation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--policy",
        policy,
        "--log-level",
        "warning",
        # its default polls workers every 30 s at start-up
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        "60",
        *extra,
    ]
    for engine in engines.prefill:
        argv += ["--prefill", engine.url]
    for engine in engines.decode:
        argv += ["--decode", engine.url]
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        with pinned(cpus):
            runner = running_process(argv, Path(tmp) / "router.log")
            process = await runner.__aenter__()
        try:
            try:
                await wait_http_ok(f"http://127.0.0.1:{port}/health", 90, process)
            except (RuntimeError, TimeoutError) as error:
                log = (Path(tmp) / "router.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"vllm-router did not start: {error}\n{log}") from None
            yield Target(name, f"http://127.0.0.1:{port}", process.pid)
        finally:
            await runner.__aexit__(None, None, None)


@contextlib.asynccontextmanager
async def running_extproc(
    name: str,
    engines: Engines,
    cpus: set[int] | None = None,
    baseline: Path | None = None,
    **extra: dict,
) -> AsyncIterator[Target]:
    """pd-extproc in a dispatch mode; `baseline`: an absolute directory holding another version's
    `extproc` package, run instead of this checkout's (A/B in one run)."""
    dispatch = {"mode": EXTPROC_MODES[name], **extra.pop("dispatch", {})}
    pools = {role: extra.pop(role) for role in ("prefill", "decode") if role in extra}
    config = ephemeral_config(
        engines.addresses("prefill"), engines.addresses("decode"), dispatch=dispatch, **extra
    )
    for role, section in pools.items():  # a pool's settings beside its endpoints
        config[role] = {**config[role], **section}
    env = None if baseline is None else {"PYTHONPATH": str(baseline), "PYTHONSAFEPATH": "1"}
    if baseline is not None:  # an older version refuses the settings it does not know
        config["metrics"].pop("ready_detail", None)
    with pinned(cpus):
        runner = running_sidecar(config, log_level="WARNING", env=env)
        sidecar = await runner.__aenter__()
    try:
        yield Target(name, sidecar.url, sidecar.pid, sidecar.metrics, sidecar.envoy_admin)
    finally:
        await runner.__aexit__(None, None, None)


@contextlib.asynccontextmanager
async def running_target(
    name: str,
    engines: Engines,
    router_bin: Path | None,
    cpus: set[int] | None = None,
    router_flags: Sequence[str] = (),
) -> AsyncIterator[Target]:
    """`router_flags`: more of vllm-router's flags (its data-parallel size)."""
    if name == "direct":
        yield Target("direct", engines.decode[0].url, None)
    elif name == "vllm-router":
        if router_bin is None:
            raise RuntimeError("vllm-router is not available")
        async with running_router(engines, router_bin, cpus, extra=router_flags) as target:
            yield target
    else:
        async with running_extproc(name, engines, cpus) as target:
            yield target


@contextlib.asynccontextmanager
async def running_floor(
    mode: str,
    engines: Engines,
    identity: dict,
    prompt: dict,
    cpus: set[int] | None = None,
    name: str = "floor",
) -> AsyncIterator[Target]:
    """The do-nothing ext_proc of `bench/floor_extproc.py` behind the Envoy pd-extproc renders
    for the same config (push dispatch); `mode`: its LLM routes' processing mode."""
    config = ephemeral_config(
        engines.addresses("prefill"), engines.addresses("decode"), dispatch={"mode": "push"}
    )
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
        config_path, ready = Path(tmp) / "config.yaml", Path(tmp) / "ready.json"
        config_path.write_text(yaml.safe_dump(config))
        argv = [
            sys.executable,
            str(FLOOR),
            "--config",
            str(config_path),
            "--prefill",
            engines.addresses("prefill")[0],
            "--decode",
            engines.addresses("decode")[0],
            "--identity",
            orjson.dumps(identity).decode(),
            "--prompt",
            orjson.dumps(prompt).decode(),
            "--mode",
            mode,
            "--ready-file",
            str(ready),
        ]
        with pinned(cpus):
            runner = running_process(argv, Path(tmp) / "floor.log")
            process = await runner.__aenter__()
        try:
            async with asyncio.timeout(60):
                while not ready.exists():
                    if process.returncode is not None:
                        log = (Path(tmp) / "floor.log").read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"the floor ext_proc exited:\n{log}")
                    await asyncio.sleep(0.1)
            info = orjson.loads(ready.read_bytes())
            yield Target(name, info["url"], process.pid, None, info["envoy_admin"])
        finally:
            await runner.__aexit__(None, None, None)
