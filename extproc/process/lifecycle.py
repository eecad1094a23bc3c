"""One process's life, the same for `up`, `serve` and `epp`: bind, start, serve until SIGTERM or
SIGINT (SIGHUP reloads the config meanwhile), drain, stop.

Binding comes first so that a port in use fails at once, with one line; SIGHUP is taken from
then on (before it, its default ends the process). Every step that fails leaves nothing
running behind it: the service releases what it had bound before the error goes up.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from extproc.reload import HangupReloads

__all__ = ["Service", "Started", "run", "write_ready"]

log = logging.getLogger("extproc")


class Started(Protocol):
    """What a service says once it serves: the ready file's JSON and a line for the user."""

    @property
    def banner(self) -> str: ...
    def to_json(self) -> bytes: ...


class Service(Protocol):
    """`up`'s Sidecar (the ext_proc and its Envoy), or the ext_proc alone (`serve`, `epp`)."""

    async def bind(self) -> None: ...  # ports and child processes
    async def start(self) -> Started: ...  # health checks, probes, then readiness
    async def reload(self, config_path: Path) -> object: ...
    async def failed(self) -> str: ...  # what ended it unasked (Envoy exited), if anything can
    async def drain(self) -> None: ...  # no new requests; those in flight finish, bounded
    async def stop(self) -> None: ...


def write_ready(path: Path | None, payload: bytes) -> None:
    """Atomically, so that a watcher never reads half a file."""
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(payload)
        tmp.rename(path)


async def run(
    service: Service, config_path: Path, ready_file: Path | None, stop: asyncio.Event
) -> int:
    """Serve until `stop` is set (0, after a drain) or the service fails by itself (1)."""
    await service.bind()
    reloads = HangupReloads(lambda: service.reload(config_path))
    try:
        started = await service.start()
        write_ready(ready_file, started.to_json())
        print(started.banner, flush=True)
        failure = await _until_stopped(service, stop)
    finally:
        reloads.close()
    if failure is None:
        await service.drain()
    else:
        log.error("%s", failure)
    await service.stop()
    return 0 if failure is None else 1


async def _until_stopped(service: Service, stop: asyncio.Event) -> str | None:
    """None once `stop` is set; the service's failure if that comes first."""
    failed = asyncio.create_task(service.failed())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        failed.cancel()
        stopped.cancel()
    return failed.result() if failed.done() and not failed.cancelled() else None
