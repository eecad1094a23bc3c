"""SIGHUP: re-read the config file; new requests use it, requests in flight are untouched.

Taken by `extproc.process.lifecycle.run` for `up`, `serve` and `epp` alike, so that
`kill -HUP` means the same in every mode.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from extproc.wiring import Runtime

__all__ = ["HangupReloads", "reload_runtime"]

log = logging.getLogger("extproc")


async def reload_runtime(
    runtime: Runtime, path: Path, adjust: Callable[[Config], Config] = lambda config: config
) -> Config | None:
    """Load `path` and hand it to the runtime (`adjust`ed: a worker's share of the limits);
    the loaded config, or None (config kept) when the file is invalid."""
    try:
        config = await asyncio.to_thread(load_config, path)
    except ConfigError as error:
        log.error("reload refused, keeping the running config:\n%s", error)
        return None
    for section in runtime.reload(adjust(config)):
        log.warning("reload: %s changed; that takes a restart to apply", section)
    await runtime.discover()
    log.info("configuration reloaded from %s", path)
    return config


class HangupReloads:
    """Runs `reload` on every SIGHUP; owns those tasks and cancels them on close."""

    def __init__(self, reload: Callable[[], Awaitable[object]]) -> None:
        self._reload = reload
        self._tasks: set[asyncio.Task[object]] = set()
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGHUP, self._start)

    def _start(self) -> None:
        task: asyncio.Task[object] = asyncio.ensure_future(self._reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        self._loop.remove_signal_handler(signal.SIGHUP)
        for task in self._tasks:
            task.cancel()
