"""The ext_proc as a service: its runtime and its server, bound, started, reloaded, stopped.

It runs alone for `serve` (beside an Envoy someone else runs) and `epp` (a gateway's endpoint
picker: P legs straight to the engines, TLS, the protocol's health services), and is the
ext_proc half of `up`'s Sidecar.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from extproc.config import Config
from extproc.process.memory import keep_large_buffers_warm
from extproc.process.server import ExtProcServer
from extproc.reload import reload_runtime
from extproc.wiring import Runtime

__all__ = ["NO_LISTENER", "ExtProcAddresses", "ExtProcService"]

log = logging.getLogger("extproc")

NO_LISTENER = "unix:/nonexistent"  # an endpoint picker's P legs go straight to the engines


@dataclass(frozen=True)
class ExtProcAddresses:
    extproc: str
    metrics: str
    health_port: int | None  # an endpoint picker's plaintext gRPC health port (0: none)
    eds_access_log: str = ""  # EDS and the access log, when on a listener of their own

    @property
    def banner(self) -> str:
        if self.health_port is None:
            return f"pd-extproc ext_proc on {self.extproc}, metrics {self.metrics}/metrics"
        return (
            f"pd-extproc endpoint picker on {self.extproc}, gRPC health on port "
            f"{self.health_port or 'of the ext_proc'}, metrics {self.metrics}/metrics"
        )

    def to_json(self) -> bytes:
        ready: dict[str, object] = {"extproc": self.extproc, "metrics": self.metrics}
        if self.health_port is not None:
            ready["health_port"] = self.health_port
        if self.eds_access_log:
            ready["eds_access_log"] = self.eds_access_log
        return orjson.dumps(ready)


class ExtProcService:
    def __init__(
        self,
        config: Config,
        prefill_listener: str,
        endpoint_picker: bool = False,
        listen: str | None = None,
    ) -> None:
        # Before any thread allocates (each would keep a heap of its own): request bodies'
        # copies reuse memory already touched, given back once the big bodies are gone.
        warm = keep_large_buffers_warm()
        self.runtime = Runtime(config, prefill_listener, endpoint_picker=endpoint_picker)
        self.server = ExtProcServer(
            self.runtime, endpoint_picker=endpoint_picker, listen=listen, trim_memory=warm
        )
        self._endpoint_picker = endpoint_picker

    async def bind(self) -> None:
        """The first membership (the first EDS answer already knows every pool member), then
        the server's ports; if one cannot be bound, what was is released (one line, no leak)."""
        try:
            await self.runtime.discover()
            await self.server.start()
        except BaseException:
            await self.server.stop(0)
            raise

    async def start(self) -> ExtProcAddresses:
        """Health checks, identity probes, KV checks; then readiness turns SERVING."""
        try:
            await self.runtime.start()
            await self.server.ready()
        except BaseException:
            await self.stop()
            raise
        return self.addresses()

    def addresses(self) -> ExtProcAddresses:
        server = self.server
        metrics = f"http://{self.runtime.config.metrics.host}:{server.metrics_port}"
        return ExtProcAddresses(
            server.address,
            metrics,
            server.health_port if self._endpoint_picker else None,
            server.eds_access_log_address,
        )

    async def reload(
        self, config_path: Path, adjust: Callable[[Config], Config] = lambda config: config
    ) -> Config | None:
        """SIGHUP: new requests use the new config (`adjust`ed); None (config kept) when it
        is invalid."""
        return await reload_runtime(self.runtime, config_path, adjust)

    async def failed(self) -> str:
        """Nothing ends the ext_proc alone but a signal."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def drain(self) -> None:
        """The drain itself is `stop`'s: health turns NOT_SERVING, new streams are refused
        (Envoy answers them with its JSON 503), streams in flight finish for up to
        timeouts.drain_s."""
        log.info("draining %d open requests", self.runtime.active_streams)

    async def stop(self) -> None:
        await self.server.stop(self.runtime.config.timeouts.drain_s)
