"""Small process helpers shared by the benchmarks: CPU pinning, free ports, bounded waits.

Everything a benchmark starts must stop, also on errors, Ctrl-C and SIGTERM, so each helper
here is an async context manager that stops its process group with SIGTERM and then SIGKILL,
and `run_bench` turns a SIGTERM into the cancellation that unwinds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from extproc.process.subprocesses import terminate

ALL_CPUS: frozenset[int] = frozenset(os.sched_getaffinity(0))


def run_bench(main: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run where SIGTERM cancels `main` like Ctrl-C does: the context managers that
    started engines and proxies stop them instead of leaving them orphaned."""

    async def guarded() -> Any:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await main

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        sys.exit(128 + signal.SIGTERM)


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Run the block with this process pinned to `cpus`, so children started in it inherit them.

    Affinity is inherited at fork, which is the only way to pin every thread of a
    multi-threaded child (Envoy, the router's tokio pool) without chasing its tasks later.
    """
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus & ALL_CPUS or ALL_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def free_port() -> int:
    """A port the OS considers free now, for programs that cannot bind port 0 themselves."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (its threads included, children not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (e.g. the Envoy that `pd-extproc up` starts)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


async def wait_http_ok(url: str, timeout_s: float, process: asyncio.subprocess.Process) -> None:
    """Poll `url` until it answers 200; fail fast if the process dies, fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            if process.returncode is not None:
                raise RuntimeError(f"process exited with {process.returncode} before {url} was up")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")


@contextlib.asynccontextmanager
async def running_process(
    argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """Start argv in its own session (so its whole group can be stopped), log to log_path."""
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    try:
        yield process
    finally:
        await terminate(process, 10.0, whole_group=True)
