"""`up`: the ext_proc and its Envoy as one unit, started in the right order, stopped together.

Only this Envoy reaches the ext_proc's gRPC services (ext_proc, the pools' EDS, the access
log): they listen on a Unix socket in the run directory, which only this user can enter (mode
0700), never on a TCP port that any local process (or, off loopback, any host) could call.

Order matters: the ext_proc binds first (Envoy's bootstrap names its socket), Envoy starts and
becomes ready, and only then do health checks and identity probes run (they go through
Envoy's prefill listener). `extproc.process.lifecycle.run` drives it, as it drives the ext_proc
alone.
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
from extproc.process.cpus import available_cpus, worker_count, workers_above_cpus
from extproc.process.envoy_process import EnvoyProcess
from extproc.process.extproc_service import ExtProcService
from extproc.process.workers import (
    WorkerProcesses,
    kv_relay,
    limits_share,
    load_table,
    share_load,
)
from extproc.scheduling.shared_load import table_bytes

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

    @property
    def banner(self) -> str:
        return (
            f"pd-extproc is up: {self.url}/v1/completions "
            f"(metrics {self.metrics}/metrics, Envoy admin {self.envoy_admin})"
        )


def private_extproc_socket(config: Config, run_dir: Path) -> str:
    """Where `up`'s ext_proc listens: the configured Unix socket, else one in the run
    directory. extproc.host/port are for `serve`, whose Envoy is the user's."""
    if config.extproc.host.startswith("unix:"):
        return config.extproc.host
    if config.extproc.host not in ("127.0.0.1", "::1", "localhost"):  # meant for other hosts
        log.warning(
            "up: the ext_proc listens on a Unix socket in %s, not on extproc.host %s "
            "(only this Envoy may reach it; extproc.host/port are for serve)",
            run_dir,
            config.extproc.host,
        )
    return f"unix:{run_dir / 'extproc.sock'}"


class Sidecar:
    def __init__(
        self, config: Config, run_dir: Path | None = None, listen_setting: str = "envoy.listen.port"
    ) -> None:
        """`listen_setting`: what moves the clients' port, named when it is taken."""
        self.config = config
        self.cpus = available_cpus()
        # the ext_proc processes, this one too (extproc.workers: auto leaves Envoy its CPUs)
        self.processes = worker_count(config.extproc.workers, self.cpus, config.envoy.concurrency)
        self._own_run_dir = run_dir is None  # a temporary one is removed on stop
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="pd-extproc-"))
        self.prefill_listener = (
            config.envoy.prefill_listener or f"unix:{self.run_dir / 'prefill.sock'}"
        )
        if self.processes > 1 and config.extproc.share_load:  # zeroed: every row empty
            table = load_table(self.run_dir)
            table.write_bytes(bytes(table_bytes(self.processes)))
        self.extproc = ExtProcService(
            self._share(config),
            self.prefill_listener,
            listen=private_extproc_socket(config, self.run_dir),
        )
        self.runtime = self.extproc.runtime
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
        self.workers = WorkerProcesses(config, self.run_dir, self.prefill_listener, private=True)
        self.addresses: SidecarAddresses | None = None

    async def bind(self) -> None:
        """The ext_proc (its first membership, then its ports), its workers, then Envoy."""
        await self.extproc.bind()  # Envoy's first EDS answer holds every member
        if (above := workers_above_cpus(self.processes, self.cpus)) is not None:
            log.warning("%s", above)
        try:
            await self.workers.start(self.processes - 1)
            self.extproc.server.worker_metrics = self.workers.metrics
            extproc = self._extproc_addresses()
            bootstrap = render_bootstrap(self.config, extproc, self.prefill_listener)
            self.envoy.config_path.write_text(render_yaml(bootstrap))
            await self.envoy.start()
            self.extproc.server.envoy_admin = self.envoy.admin_url  # its stats, on our port
        except BaseException:
            await self._failed_start()
            raise

    async def start(self) -> SidecarAddresses:
        """Health checks and probes (through Envoy's prefill listener), then readiness."""
        try:
            await self.runtime.start()
            await self.extproc.server.ready()
            ingress = await self.envoy.listener_address("ingress")
        except BaseException:
            await self._failed_start()
            raise
        self.addresses = SidecarAddresses(
            url=f"http://{ingress}",
            envoy_admin=self.envoy.admin_url,
            metrics=self.extproc.addresses().metrics,
            extproc=self._extproc_addresses(),
            prefill_listener=self.prefill_listener,
            worker_metrics=self.workers.metrics,
        )
        return self.addresses

    def _extproc_addresses(self) -> str:
        return ",".join([self.extproc.server.address, *self.workers.addresses])

    async def _failed_start(self) -> None:
        self._own_run_dir = False  # keep Envoy's log for the user to read
        await self.stop()

    async def reload(self, config_path: Path) -> None:
        """SIGHUP: new requests use the new config; requests in flight are untouched."""
        config = await self.extproc.reload(config_path, self._share)
        if config is None:
            return
        await self.workers.reload(config)  # they serve EDS too: same members everywhere
        self.config = config

    def _share(self, config: Config) -> Config:
        """This process's part of the limits the sidecar's processes share; with others,
        it relays the KV events engines send it to them."""
        shared = share_load(limits_share(config, self.processes), self.processes, 0, self.run_dir)
        if self.processes <= 1:
            return shared
        relay = config.kv_listener.model_copy(update={"relay": kv_relay(self.run_dir)})
        return shared.model_copy(update={"kv_listener": relay})

    async def failed(self) -> str:
        """Envoy exited by itself."""
        code = await self.envoy.wait()
        return f"Envoy exited ({code}); see {self.envoy.log_path}"

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
            self.envoy.stop(),
            self.extproc.stop(),
            self.workers.stop(grace),
            return_exceptions=True,
        )
        if self._own_run_dir:
            await asyncio.to_thread(shutil.rmtree, self.run_dir, ignore_errors=True)
