"""The ext_proc process: gRPC server (ExternalProcessor, the pools' EDS, AccessLogService for the
client's latency, grpc.health), and the metrics/probes HTTP port.

`ExtProcServer.start()` binds both (port 0 picks a free port; the bound ports are attributes
afterwards); the caller starts the runtime's health checks and probes once Envoy's prefill
listener exists. `stop(grace)` lets in-flight streams finish for up to `grace` seconds.

HTTP: `/metrics` (Prometheus), `/ready` (200 once serving, 503 while starting or draining;
why in a few words; `/ready?verbose` the engines' detail, when metrics.ready_detail is on),
`/live` (200 while the process answers at all) and
`/envoy/stats/prometheus`: the stats of the Envoy in this pod, whose admin port stays on loopback
(a cluster's Prometheus scrapes them here, next to the sidecar's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
from typing import Any

import aiohttp
import grpc
import orjson
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc import aio
from grpc_health.v1 import health_pb2_grpc

from extproc.config import Config, ConfigError
from extproc.membership.eds import EndpointDiscovery
from extproc.process.grpc_health import HealthServices, health_server
from extproc.process.memory_trim import MemoryTrim
from extproc.process.ports import PortInUse
from extproc.process.serving_tls import configured_credentials, self_signed_credentials
from extproc.process.worker_pages import merged_pages, worker_pages
from extproc.request.access_log import ClientLatency
from extproc.request.processor import RequestProcessor
from extproc.request.stream import EnvoyStream
from extproc.wiring import Runtime

__all__ = ["ENVOY_STATS_PATH", "GRPC_OPTIONS", "LIVE_PATH", "READY_PATH", "ExtProcServer"]

log = logging.getLogger("extproc.process.server")

READY_PATH = "/ready"  # Kubernetes readinessProbe: this process can answer Envoy
LIVE_PATH = "/live"  # livenessProbe: this process answers at all
ENVOY_STATS_PATH = "/envoy/stats/prometheus"
_ENVOY_STATS_TIMEOUT = aiohttp.ClientTimeout(total=5)
_ENVOY_STATS_MAX_BYTES = 8 * 1024 * 1024  # far above the stats of the clusters pd-extproc renders

# Whole bodies travel in one gRPC message; Python's default 4 MiB would cap prompts.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_concurrent_streams", 100_000),
    # Envoy pings every 30 s (cluster keepalive); don't punish it with GOAWAY.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.so_reuseport", 0),
]


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def Process(self, request_iterator: Any, context: aio.ServicerContext) -> None:
        with self.runtime.stream():
            await RequestProcessor(self.runtime.request_deps, EnvoyStream(context)).run()


async def _credentials(cfg: Config, endpoint_picker: bool) -> grpc.ServerCredentials | None:
    """The ext_proc port's TLS, or None for plaintext."""
    client_ca = cfg.endpoint_picker.client_ca_file if endpoint_picker else None
    if cfg.extproc.tls is not None:
        return await asyncio.to_thread(configured_credentials, cfg.extproc.tls, client_ca)
    if endpoint_picker and cfg.endpoint_picker.secure_serving:
        return await asyncio.to_thread(self_signed_credentials, client_ca)
    return None


_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the final NUL (Linux)


def _check_feeds_private(cfg: Config) -> None:
    """`serve` with EDS and the access log on the ext_proc port: that port must be loopback, a
    Unix socket or mTLS, for neither service checks who calls it (the pools' members are read,
    client latencies written)."""
    host, tls = cfg.extproc.host, cfg.extproc.tls
    if host.startswith("unix:") or host == "localhost" or (tls and tls.client_cert_file):
        return
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback:
            return
    raise ConfigError(
        f"extproc.host {host}: the pools' EDS and the access-log service, which check no "
        "client, would listen there too: give them a loopback listener of their own "
        "(extproc.eds_access_log: {host: 127.0.0.1, port: 50052}, or unix:/path), or require "
        "Envoy's client certificate (extproc.tls with client_cert_file)"
    )


def _verifies_clients(cfg: Config) -> bool:
    """The endpoint picker's port refuses a client without a certificate it trusts."""
    if cfg.endpoint_picker.client_ca_file is not None:
        return True
    return cfg.extproc.tls is not None and cfg.extproc.tls.client_cert_file is not None


def _warn_of_any_client(cfg: Config, address: str) -> None:
    """GIE's gateways connect without a client certificate by default, so the picker takes any
    client by default too; whoever reaches the port can then route requests and start P legs."""
    if _verifies_clients(cfg):
        return
    log.warning(
        "the endpoint picker on %s accepts any client that reaches it (no client certificate "
        "is checked): anyone there can route requests and start prefills; set "
        "endpoint_picker.client_ca_file to the CA of the gateway's client certificates, or "
        "let only the gateway reach the port (a NetworkPolicy)",
        address,
    )


def _check_socket_path(path: str, setting: str) -> None:
    """What would make a Unix socket fail to bind, named before gRPC says "in use" for all."""
    folder = os.path.dirname(path) or "."
    setting = setting.removesuffix(".port") + ".host"  # a socket is named by the host key
    if not os.path.isdir(folder):
        raise ConfigError(
            f"{setting}: unix:{path}: the directory {folder} does not exist; create it or "
            "choose another path"
        )
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise ConfigError(
            f"{setting}: unix:{path}: longer than {_MAX_SOCKET_PATH} bytes, the limit of a "
            "Unix socket's path; choose a shorter one"
        )


def _bind(
    server: aio.Server, wanted: str, credentials: grpc.ServerCredentials | None, setting: str
) -> str:
    """Bind `wanted` ("host:port", port 0 = any free one, or "unix:/path"); the bound address."""
    if wanted.startswith("unix:"):
        _check_socket_path(wanted.removeprefix("unix:"), setting)
        with contextlib.suppress(FileNotFoundError):  # a previous run's socket
            os.unlink(wanted.removeprefix("unix:"))
    try:  # grpc raises RuntimeError, or returns 0 in older releases
        if credentials is None:
            port = server.add_insecure_port(wanted)
        else:
            port = server.add_secure_port(wanted, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise PortInUse(wanted, setting)
    return wanted if wanted.startswith("unix:") else f"{wanted.rpartition(':')[0]}:{port}"


async def _read_at_most(stream: aiohttp.StreamReader, limit: int) -> bytes:
    chunks, size = [], 0
    while size < limit and (chunk := await stream.read(limit - size)):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class ExtProcServer:
    """`endpoint_picker`: the ext_proc as a gateway's endpoint picker (`pd-extproc epp`):
    TLS by default, health services that follow readiness, a plaintext health port."""

    def __init__(
        self,
        runtime: Runtime,
        endpoint_picker: bool = False,
        listen: str | None = None,
        trim_memory: bool = False,
    ) -> None:
        """`listen`: where the gRPC services listen instead of extproc.host/port (`up`: a Unix
        socket in its private run directory). `trim_memory`: the heap keeps large buffers
        (`keep_large_buffers_warm`), to be given back once the big bodies are gone."""
        self.runtime = runtime
        self._trim_memory = trim_memory
        self.endpoint_picker = endpoint_picker
        self._listen = listen
        self.address = ""  # "host:port" or "unix:/path", as Envoy's cluster should name it
        # where EDS and the access log listen when not on `address` (extproc.eds_access_log)
        self.eds_access_log_address = ""
        self._side: aio.Server | None = None
        self.metrics_port = 0
        # Envoy's admin ("http://host:port"), whose stats ENVOY_STATS_PATH serves; "": none known
        self.envoy_admin = ""
        # `up`'s other ext_proc processes ("http://host:port"): their series join this /metrics
        self.worker_metrics: list[str] = []
        self.health_port = 0  # the plaintext health port of an endpoint picker (0: none)
        self._grpc: aio.Server | None = None
        self._health = HealthServices(gated=endpoint_picker)
        self._health_grpc: aio.Server | None = None
        self._eds = EndpointDiscovery(runtime.memberships, runtime.metrics)
        self._http: web.AppRunner | None = None
        self._access_log = ClientLatency(
            runtime.metrics, runtime.access_log_streams, runtime.model_labels.known
        )
        self._memory_trim = MemoryTrim(runtime.request_deps.bodies)

    def _add_envoys_feeds(self, server: aio.Server) -> None:
        """The pools' EDS and the access-log service, which only Envoy may call."""
        eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(self._eds, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self._access_log, server)

    async def start(self) -> None:
        if self._trim_memory:
            self._memory_trim.start()
        cfg = self.runtime.config
        side = None if self._listen else cfg.extproc.eds_access_log  # `up`: all on its socket
        self._grpc = aio.server(options=GRPC_OPTIONS)
        ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.runtime), self._grpc)
        if side is None and not self.endpoint_picker:  # a gateway calls the ext_proc only
            if not self._listen:  # `up`'s own socket is private
                _check_feeds_private(cfg)
            self._add_envoys_feeds(self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health.servicer, self._grpc)
        credentials = await _credentials(cfg, self.endpoint_picker)
        wanted = self._listen or cfg.extproc.address
        self.address = _bind(self._grpc, wanted, credentials, "extproc.port")
        await self._grpc.start()
        if self.endpoint_picker:
            _warn_of_any_client(cfg, self.address)
        if side is not None:
            self._side = aio.server(options=GRPC_OPTIONS)
            self._add_envoys_feeds(self._side)
            setting = "extproc.eds_access_log.port"
            self.eds_access_log_address = _bind(self._side, side.address, None, setting)
            await self._side.start()
        await self._health.started()
        if self.endpoint_picker and cfg.endpoint_picker.health_port is not None:
            host = "127.0.0.1" if wanted.startswith("unix:") else cfg.extproc.host
            await self._start_health_port(host, cfg.endpoint_picker.health_port)
        self._http = web.AppRunner(self._http_app(), access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, cfg.metrics.host, cfg.metrics.port)
        try:
            await site.start()
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise PortInUse(f"{cfg.metrics.host}:{cfg.metrics.port}", "metrics.port") from None
        self.metrics_port = self._http.addresses[0][1]
        log.info(
            "ext_proc on %s%s, metrics on %s:%d",
            self.address,
            f", EDS and access log on {self.eds_access_log_address}"
            if self.eds_access_log_address
            else "",
            cfg.metrics.host,
            self.metrics_port,
        )

    async def _start_health_port(self, host: str, port: int) -> None:
        self._health_grpc = health_server(self._health)
        try:
            self.health_port = self._health_grpc.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            self.health_port = 0
        if self.health_port == 0:
            raise PortInUse(f"{host}:{port}", "endpoint_picker.health_port")
        await self._health_grpc.start()

    async def ready(self) -> None:
        """Health known and probes settled: readiness turns SERVING."""
        await self._health.ready()

    def _http_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get(READY_PATH, self._ready)
        app.router.add_get(LIVE_PATH, self._live)
        app.router.add_get(ENVOY_STATS_PATH, self._envoy_stats)
        return app

    async def _metrics(self, request: web.Request) -> web.Response:
        body = self.runtime.metrics.render()
        if self.worker_metrics:
            async with aiohttp.ClientSession() as session:
                pages = await worker_pages(session, self.worker_metrics)
            body = await asyncio.to_thread(merged_pages, [body, *pages])
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _ready(self, request: web.Request) -> web.Response:
        """The probe's answer; `?verbose` adds the engines' detail when metrics.ready_detail
        allows it (403 otherwise: it names every engine and its load)."""
        state = self.runtime.readiness()
        if "verbose" in request.query:
            if not self.runtime.config.metrics.ready_detail:
                refused = {"error": "the detail is off: set metrics.ready_detail: true"}
                return web.Response(
                    body=orjson.dumps(refused), status=403, content_type="application/json"
                )
            state = self.runtime.readiness_detail()
        return web.Response(
            body=orjson.dumps(state),
            status=200 if state["ready"] else 503,
            content_type="application/json",
        )

    async def _live(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"live":true}', content_type="application/json")

    async def _envoy_stats(self, request: web.Request) -> web.Response:
        if not self.envoy_admin:
            return web.Response(status=404, text="no Envoy admin address (config envoy.admin)\n")
        try:
            async with (
                aiohttp.ClientSession(timeout=_ENVOY_STATS_TIMEOUT) as session,
                session.get(self.envoy_admin + "/stats/prometheus") as response,
            ):
                body = await _read_at_most(response.content, _ENVOY_STATS_MAX_BYTES + 1)
        except (aiohttp.ClientError, TimeoutError) as error:
            why = str(error) or type(error).__name__
            return web.Response(status=502, text=f"Envoy admin {self.envoy_admin}: {why}\n")
        if response.status != 200 or len(body) > _ENVOY_STATS_MAX_BYTES:
            text = f"Envoy admin {self.envoy_admin}: status {response.status}, {len(body)} bytes\n"
            return web.Response(status=502, text=text)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def stop(self, grace_s: float) -> None:
        self.runtime.draining = True  # /ready turns 503 before anything is refused
        await self._health.draining()
        # EDS streams never end by themselves: end them so that the grace period waits only
        # for requests. Envoy keeps the endpoints it has until it reaches an ext_proc again.
        self._eds.close()
        self._access_log.close()
        if self._side is not None:
            await self._side.stop(None)
        if self._grpc is not None:  # Envoy's health check sees it first
            await self._grpc.stop(grace_s)
        if self._health_grpc is not None:
            await self._health_grpc.stop(None)
        if self._http is not None:
            await self._http.cleanup()
        await self._memory_trim.stop()
        await self.runtime.stop()
