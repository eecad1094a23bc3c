"""Active health checks of every engine, and the identity work that follows a transition.

Each round GETs `/health` of every decode endpoint and scrapes `/metrics` of every prefill
endpoint through the engine scraper (the same 200 as /health, and the page carries the
process start time that reveals a restart before any request does).
A prefill endpoint that becomes healthy (at start-up, or after an outage) is probed for its
identity; one that goes down loses it. `on_health` hears each engine's result of each round
(its context length is asked once it is healthy: `extproc.engines.context`).
Passive marking (a refused P leg) happens in the strategies and is undone here when the
endpoint answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import aiohttp

from extproc.config import HealthConfig
from extproc.engines.health_reasons import failure_reason
from extproc.scheduling.pool import EndpointState, Pool
from extproc.stopping import cancel_and_wait

__all__ = ["HealthChecker", "Identities"]

log = logging.getLogger("extproc.engines.health")


class Identities(Protocol):
    def missing(self, endpoint: str, data_parallel_size: int = 1) -> list[int | None]: ...
    def drop(self, endpoint: str) -> object: ...


class HealthChecker:
    def __init__(
        self,
        settings: Callable[[], HealthConfig],
        prefill: Pool,
        decode: Pool,
        identities: Identities,
        scrape_metrics: Callable[[str], Awaitable[str | None]],
        probe: Callable[[aiohttp.ClientSession, str], Coroutine[Any, Any, bool]],
        probing: Callable[[], bool],
        reprobe: Callable[[str], bool] = lambda address: False,
        ranks_of: Callable[[str], int] = lambda address: 1,  # data-parallel ranks per prefill
        on_health: Callable[[aiohttp.ClientSession, str, bool], Awaitable[None]] | None = None,
    ) -> None:
        self._on_health = on_health  # what a round found of each engine (its context length)
        self._ranks_of = ranks_of
        self._settings = settings  # re-read: a reload may change them
        self._prefill = prefill
        self._decode = decode
        self._identities = identities
        self._scrape_metrics = scrape_metrics  # why a prefill's /metrics failed, None if 200
        self._reprobe = reprobe  # probe again although its identity is known (a KV mismatch)
        self.reasons: dict[str, str] = {}  # address → why its last check failed
        self._probe = probe  # learns a prefill engine's identity
        self._probing = probing  # dispatch.probe, re-read: a reload may change it
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._probes: dict[str, asyncio.Task[bool]] = {}
        self._failures: dict[str, int] = {}
        self._wake = asyncio.Event()

    async def start(self, session: aiohttp.ClientSession) -> None:
        """One round now (so start-up knows who is down), then one every interval."""
        self._session = session
        await self.check_all(unhealthy_after=1)  # nothing is known yet: believe the first answer
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await cancel_and_wait([self._task, *self._probes.values()])

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # an early round when members change
                await asyncio.wait_for(self._wake.wait(), self._settings().interval_s)
            self._wake.clear()
            await self.check_all()

    def check_soon(self) -> None:
        """Run the next round now (new members start unhealthy until checked)."""
        self._wake.set()

    async def check_all(self, unhealthy_after: int | None = None) -> None:
        threshold = unhealthy_after or self._settings().unhealthy_after
        for pool in (self._decode, self._prefill):  # decodes first: a probe needs one
            await asyncio.gather(*(self._check(pool, state, threshold) for state in pool))
        for state in self._prefill:
            known = not self._identities.missing(state.address, self._ranks_of(state.address))
            if state.healthy and (not known or self._reprobe(state.address)):
                self._maybe_probe(state.address)

    async def _check(self, pool: Pool, state: EndpointState, unhealthy_after: int) -> None:
        prefill = pool is self._prefill
        reason = await (
            self._scrape_metrics(state.address) if prefill else self._get_health(state.address)
        )
        healthy = reason is None
        if reason is None:
            self.reasons.pop(state.address, None)
        else:
            self.reasons[state.address] = reason
        # One slow answer on a busy host is not an outage: require consecutive failures.
        failures = 0 if healthy else self._failures.get(state.address, 0) + 1
        self._failures[state.address] = failures
        if not healthy and state.healthy and failures < unhealthy_after:
            return
        if healthy != state.healthy:
            said = "healthy" if healthy else f"unhealthy: {reason}"
            log.warning("%s %s is now %s", pool.role, state.address, said)
        pool.set_healthy(state.address, healthy)
        if prefill and not healthy:
            self._identities.drop(state.address)
        if self._on_health is not None and self._session is not None:
            await self._on_health(self._session, state.address, healthy)

    async def _get_health(self, address: str) -> str | None:
        """Why a decode engine's /health is not 200, or None."""
        assert self._session is not None
        try:
            async with self._session.get(
                f"http://{address}/health",
                timeout=aiohttp.ClientTimeout(total=self._settings().timeout_s),
            ) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError) as error:
            return failure_reason(error)

    def _maybe_probe(self, address: str) -> None:
        """Probe once at a time per endpoint, when enabled and useful."""
        if not self._probing() or self._session is None:
            return
        running = self._probes.get(address)
        if running is not None and not running.done():
            return
        self._probes[address] = asyncio.create_task(self._probe(self._session, address))

    async def probes_settled(self, timeout_s: float) -> None:
        """Wait (bounded) for the probes in flight; used at start-up."""
        pending = [t for t in self._probes.values() if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
