"""Config → the live objects one ext_proc process shares between its streams.

This is the only module that names concrete classes; everything else receives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import aiohttp

from extproc.config import Config
from extproc.health import HealthChecker
from extproc.identity import IdentityCache
from extproc.kv_check import KvCheck
from extproc.load import LoadScraper
from extproc.metrics import Metrics
from extproc.picking import build_picker
from extproc.pool import EndpointState, Pool
from extproc.prefill_leg import PrefillClient

__all__ = ["Runtime"]

log = logging.getLogger("extproc")


class Runtime:
    def __init__(self, config: Config, prefill_listener: str) -> None:
        self.config = config
        self.metrics = Metrics()
        dispatch = config.dispatch
        self.identities = IdentityCache(
            dispatch.flap_threshold,
            dispatch.flap_window_s,
            dispatch.serial_cooldown_s,
            on_event=self._identity_event,
        )
        self.prefill = Pool(
            "prefill",
            [e.address for e in config.prefill.endpoints],
            build_picker(config.prefill),
            on_change=self._endpoint_changed("prefill"),
        )
        self.decode = Pool(
            "decode",
            [e.address for e in config.decode.endpoints],
            build_picker(config.decode),
            on_change=self._endpoint_changed("decode"),
        )
        for pool in (self.prefill, self.decode):
            for state in pool:
                self._endpoint_changed(pool.role)(state)
        self.prefill_client = PrefillClient(prefill_listener, config.timeouts.connect_s)
        self.health = HealthChecker(self)
        self.kv_check = KvCheck(self)
        self.load = LoadScraper(self)  # engine load for power_of_two
        self._session: aiohttp.ClientSession | None = None
        self.active_streams = 0  # Envoy streams being processed (= requests in flight)
        self.idle = asyncio.Event()  # set while no stream is open (drain waits on it)
        self.idle.set()

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Count one open Envoy stream for the whole of its processing."""
        self.active_streams += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.active_streams -= 1
            if not self.active_streams:
                self.idle.set()

    def _identity_event(self, endpoint: str, event: str) -> None:
        self.metrics.identity_events.labels(endpoint, event).inc()
        if event in ("changed", "flapping", "dropped"):
            log.info("prefill %s: identity %s", endpoint, event)

    def _endpoint_changed(self, role: str):
        def record(state: EndpointState) -> None:
            self.metrics.inflight.labels(role, state.address).set(state.in_flight)
            self.metrics.healthy.labels(role, state.address).set(1 if state.healthy else 0)

        return record

    async def start(self) -> None:
        """Health checks, identity probes and KV checks; call once Envoy is serving."""
        self._session = aiohttp.ClientSession()
        await self.health.start(self._session)
        self.kv_check.start(self._session)
        self.load.start(self._session)
        await self.health.probes_settled(self.config.timeouts.probe_s)

    async def stop(self) -> None:
        await self.kv_check.stop()
        await self.load.stop()
        await self.health.stop()
        await self.prefill_client.close()
        if self._session is not None:
            await self._session.close()

    def readiness(self) -> dict[str, object]:
        """What /ready shows: endpoint health and load, and the identity cache."""
        return {
            "ready": any(s.healthy for s in self.decode),
            "prefill": {
                s.address: {"healthy": s.healthy, "in_flight": s.in_flight} for s in self.prefill
            },
            "decode": {
                s.address: {"healthy": s.healthy, "in_flight": s.in_flight} for s in self.decode
            },
            "identities": self.identities.snapshot(),
            "decode_kv": self.kv_check.snapshot(),
        }
