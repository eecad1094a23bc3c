"""The configurations compared, each started on given engines and yielding one base URL.

direct        the client talks to the first decode engine, which prefills itself
vllm-router   vllm-router 0.1.17 in PD mode (it turns on parallel push by itself)
pull          pd-extproc, NIXL pull engines, serial dispatch
serial-push   pd-extproc, push engines, P then D (the baseline of PR #187)
push          pd-extproc, push engines, both legs at once
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.engines import Engines
from bench.procs import free_port, pinned, running_process, wait_http_ok
from extproc.testing import ephemeral_config, running_sidecar

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
    config = ephemeral_config(
        engines.addresses("prefill"), engines.addresses("decode"), dispatch=dispatch, **extra
    )
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
