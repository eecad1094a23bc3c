"""vllmsim engines as members of a topology: their connectors, their model, their address."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from vllmsim.launcher import PULL_D, PULL_P, PUSH_D, PUSH_P, EngineHandle, running_engine

PUSH = (PUSH_P, PUSH_D)
PULL = (PULL_P, PULL_D)
MODEL = "sim-model"


def address(engine: EngineHandle) -> str:
    return f"127.0.0.1:{engine.port}"


async def start_engines(
    stack: contextlib.AsyncExitStack,
    count: int,
    connector: str,
    flags: Sequence[str] | Callable[[], Sequence[str]] = (),
) -> list[EngineHandle]:
    """`count` engines with this KV connector, stopped when `stack` closes. `flags`: the
    same for each, or made for each (a callable)."""
    return [
        await stack.enter_async_context(
            running_engine(
                "--kv-transfer-config", connector, *(flags() if callable(flags) else flags)
            )
        )
        for _ in range(count)
    ]


async def engine_requests(
    session: aiohttp.ClientSession, engine: EngineHandle
) -> list[dict[str, Any]]:
    """What `engine` received (vllmsim's request log), the sidecar's identity probes excluded."""
    async with session.get(engine.url + "/sim/requests") as response:
        records: list[dict[str, Any]] = await response.json()
    return [r for r in records if not (r["x_request_id"] or "").startswith("pd-extproc-probe-")]


async def clear_engines(session: aiohttp.ClientSession, engines: Sequence[EngineHandle]) -> None:
    """Forget what the engines received and the faults a test set on them."""
    for engine in engines:
        async with session.delete(engine.url + "/sim/requests"):
            pass
        async with session.delete(engine.url + "/sim/faults"):
            pass


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a process that must be told it before it starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def two_free_ports() -> int:
    """A port p with p + 1 free as well (for ranks 0 and 1 of a data-parallel server)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return int(port)
    raise AssertionError("no two consecutive free ports")
