"""`up`: the ext_proc and its Envoy as one unit, started in the right order, stopped together.

Order matters: the ext_proc binds first (Envoy's bootstrap names its port), Envoy starts and
becomes ready, and only then do health checks and identity probes run (they go through
Envoy's prefill listener).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

from extproc.bootstrap.render import render_bootstrap, render_yaml
from extproc.config import Config
from extproc.process.envoy_process import EnvoyProcess
from extproc.process.server import ExtProcServer
from extproc.process.workers import WorkerProcesses
from extproc.reload import reload_runtime
from extproc.wiring import Runtime

__all__ = ["Sidecar", "SidecarAddresses"]

log = logging.getLogger("extproc")


@dataclass(frozen=True)
class SidecarAddresses:
    url: str  # the OpenAI endpoint (Envoy's ingress listener)
    envoy_admin: str
    metrics: str
    extproc: str  # comma list when there are several workers
    prefill_listener: str
    worker_metrics: list[str]  # /metrics base URLs of the extra ext_proc workers

    def to_json(self) -> bytes:
        return orjson.dumps(self.__dict__)


class Sidecar:
    def __init__(
        self, config: Config, run_dir: Path | None = None, listen_setting: str = "envoy.listen.port"
    ) -> None:
        """`listen_setting`: what moves the clients' port, named when it is taken."""
        self.config = config
        self._own_run_dir = run_dir is None  # a temporary one is removed on stop
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="pd-extproc-"))
        self.prefill_listener = (
            config.envoy.prefill_listener or f"unix:{self.run_dir / 'prefill.sock'}"
        )
        self.runtime = Runtime(config, self.prefill_listener)
        self.server = ExtProcServer(self.runtime)
        self.envoy = EnvoyProcess(
            self.run_dir / "envoy.yaml",
            self.run_dir,
            config.envoy.log_level,
            config.envoy.concurrency,
            {
                f"{config.envoy.listen.host}:{config.envoy.listen.port}": listen_setting,
                config.envoy.prefill_listener: "envoy.prefill_listener",
            },
        )
        self.workers = WorkerProcesses(config, self.run_dir, self.prefill_listener)
        self.addresses: SidecarAddresses | None = None

    async def start(self) -> SidecarAddresses:
        cfg = self.config
        try:
            await self.server.start()
            await self.workers.start(cfg.extproc.workers - 1)
            extproc = ",".join([self.server.address, *self.workers.addresses])
            bootstrap = render_bootstrap(cfg, extproc, self.prefill_listener)
            self.envoy.config_path.write_text(render_yaml(bootstrap))
            await self.runtime.discover()  # Envoy's first EDS answer holds every member
            await self.envoy.start()
            self.server.envoy_admin = self.envoy.admin_url
            await self.runtime.start()
            await self.server.ready()
            ingress = await self.envoy.listener_address("ingress")
        except BaseException:
            self._own_run_dir = False  # keep Envoy's log for the user to read
            await self.stop()
            raise
        self.addresses = SidecarAddresses(
            url=f"http://{ingress}",
            envoy_admin=self.envoy.admin_url,
            metrics=f"http://{cfg.metrics.host}:{self.server.metrics_port}",
            extproc=extproc,
            prefill_listener=self.prefill_listener,
            worker_metrics=self.workers.metrics,
        )
        return self.addresses

    async def reload(self, config_path: Path) -> None:
        """SIGHUP: new requests use the new config; requests in flight are untouched."""
        config = await reload_runtime(self.runtime, config_path)
        if config is None:
            return
        await self.workers.reload(config)  # they serve EDS too: same members everywhere
        self.config = config

    async def wait_envoy_exit(self) -> int:
        return await self.envoy.wait()

    async def drain(self) -> None:
        """Take no new requests; let those in flight finish, for at most timeouts.drain_s."""
        self.runtime.draining = True
        await self.envoy.drain_inbound()
        try:
            await asyncio.wait_for(self.runtime.idle.wait(), self.config.timeouts.drain_s)
        except TimeoutError:
            log.warning(
                "drain: %d requests still open after %g s; closing them",
                self.runtime.active_streams,
                self.config.timeouts.drain_s,
            )

    async def stop(self) -> None:
        grace = self.config.timeouts.drain_s
        await asyncio.gather(
            self.envoy.stop(), self.server.stop(grace), self.workers.stop(grace),
            return_exceptions=True,
        )  # fmt: skip
        if self._own_run_dir:
            await asyncio.to_thread(shutil.rmtree, self.run_dir, ignore_errors=True)
