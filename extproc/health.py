"""Active health checks of every engine, and the identity work that follows a transition.

Each round GETs `/health` of every decode endpoint and `/metrics` of every prefill endpoint
directly (a changed `process_start_time_seconds` reveals a restart before any request does).
A prefill endpoint that becomes healthy (at start-up, or after an outage) is probed for its
identity; one that goes down loses it.
Passive marking (a refused P leg) happens in the processor and is undone here when the
endpoint answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import aiohttp

if TYPE_CHECKING:
    from extproc.config import Config
    from extproc.metrics import Metrics
    from extproc.pool import EndpointState, Pool

__all__ = ["HealthChecker"]

log = logging.getLogger("extproc.health")

# Prefill engines are checked through /metrics: the same 200 as /health, plus the process
# start time that reveals a restart (vLLM and vllmsim both export it).
_START_TIME = re.compile(rb"^process_start_time_seconds\S* (\S+)$", re.MULTILINE)


class Identities(Protocol):
    """What the checker needs of the identity cache."""

    def get(self, endpoint: str) -> object | None: ...
    def drop(self, endpoint: str) -> bool: ...


# (session, prefill address, endpoints that refused the key) → learned
Probe = Callable[[aiohttp.ClientSession, str, set[str]], Awaitable[bool]]


class HealthChecker:
    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        identities: Identities,
        metrics: Metrics,
        config: Callable[[], Config],  # the current config: a reload swaps it
        probe: Probe,
    ) -> None:
        self._prefill, self._decode = prefill, decode
        self._identities = identities
        self._metrics = metrics
        self._config = config
        self._probe = probe
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._probes: dict[str, asyncio.Task[bool]] = {}
        self._probe_refused: set[str] = set()  # endpoints that refused the probe's API key
        self._failures: dict[str, int] = {}
        self._start_times: dict[str, float] = {}
        self._wake = asyncio.Event()

    async def start(self, session: aiohttp.ClientSession) -> None:
        """One round now (so start-up knows who is down), then one every interval."""
        self._session = session
        await self.check_all(unhealthy_after=1)  # nothing is known yet: believe the first answer
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *self._probes.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # an early round when members change
                await asyncio.wait_for(self._wake.wait(), self._config().health.interval_s)
            self._wake.clear()
            await self.check_all()

    def check_soon(self) -> None:
        """Run the next round now (new members start unhealthy until checked)."""
        self._wake.set()

    async def check_all(self, unhealthy_after: int | None = None) -> None:
        threshold = unhealthy_after or self._config().health.unhealthy_after
        pools = (self._decode, self._prefill)  # decodes first: a probe needs one
        for pool in pools:
            await asyncio.gather(*(self._check(pool, state, threshold) for state in pool))
        for state in self._prefill:
            if state.healthy and self._identities.get(state.address) is None:
                self._maybe_probe(state.address)

    async def _check(self, pool: Pool, state: EndpointState, unhealthy_after: int) -> None:
        prefill = pool is self._prefill
        healthy, started = await self._fetch(state.address, "/metrics" if prefill else "/health")
        # One slow answer on a busy host is not an outage: require consecutive failures.
        failures = 0 if healthy else self._failures.get(state.address, 0) + 1
        self._failures[state.address] = failures
        if not healthy and state.healthy and failures < unhealthy_after:
            return
        if healthy != state.healthy:
            log.warning(
                "%s %s is now %s", pool.role, state.address, "healthy" if healthy else "unhealthy"
            )
        pool.set_healthy(state.address, healthy)
        if prefill and not healthy:
            self._identities.drop(state.address)
        if prefill and started is not None:
            self._note_start_time(state.address, started)

    async def _fetch(self, address: str, path: str) -> tuple[bool, float | None]:
        """(answered 200, the engine's process_start_time_seconds if the body has it)."""
        assert self._session is not None
        try:
            async with self._session.get(
                f"http://{address}{path}",
                timeout=aiohttp.ClientTimeout(total=self._config().health.timeout_s),
            ) as response:
                if response.status != 200:
                    return False, None
                match = _START_TIME.search(await response.read())
        except (aiohttp.ClientError, TimeoutError):
            return False, None
        return True, None if match is None else float(match.group(1))

    def _note_start_time(self, address: str, started: float) -> None:
        """A new process start time is a restart: its identity is stale before any request."""
        previous = self._start_times.get(address)
        self._start_times[address] = started
        if previous is not None and previous != started:
            log.warning("prefill %s restarted; its identity is dropped and re-learned", address)
            self._metrics.identity_events.labels(address, "restarted").inc()
            self._identities.drop(address)

    def _maybe_probe(self, address: str) -> None:
        """Probe once at a time per endpoint, when enabled and useful."""
        if not self._config().dispatch.probe or self._session is None:
            return
        running = self._probes.get(address)
        if running is not None and not running.done():
            return
        self._probes[address] = asyncio.create_task(
            self._probe(self._session, address, self._probe_refused)
        )

    async def probes_settled(self, timeout_s: float) -> None:
        """Wait (bounded) for the probes in flight; used at start-up."""
        pending = [t for t in self._probes.values() if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
