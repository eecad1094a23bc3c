"""The gRPC health services (grpc.health.v1) and what each one reports.

Envoy health-checks its ext_proc cluster with the ext_proc service name; Kubernetes probes an
endpoint picker with gRPC probes, whose service names the Gateway API Inference Extension
protocol fixes: `liveness` (the process answers) and `readiness` (it may take requests);
`inference-extension` is the name the reference endpoint picker's manifests probe. Kubelet's
gRPC probes cannot speak TLS, so an endpoint picker also serves them on a plaintext port
(`health_server`).

  liveness                          SERVING from the start
  readiness, inference-extension    SERVING once ready (health known, probes settled)
  the ext_proc service, ""          from the start, or once ready when `gated` (endpoint
                                    picker: the protocol makes it follow readiness)
Draining turns every one NOT_SERVING (Envoy and the kubelet see it before anything is refused).
"""

from __future__ import annotations

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

__all__ = ["EXTPROC_SERVICE", "LIVENESS", "READINESS", "HealthServices", "health_server"]

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"
_REFERENCE_PROBE = "inference-extension"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServices:
    def __init__(self, gated: bool) -> None:
        self.servicer = health.aio.HealthServicer()
        self._ready_ones = [READINESS, _REFERENCE_PROBE]
        self._extproc = [EXTPROC_SERVICE, ""]
        if gated:
            self._ready_ones += self._extproc

    async def started(self) -> None:
        await self._set([LIVENESS], _SERVING)
        await self._set(self._ready_ones, _NOT_SERVING)
        await self._set([s for s in self._extproc if s not in self._ready_ones], _SERVING)

    async def ready(self) -> None:
        await self._set(self._ready_ones, _SERVING)

    async def draining(self) -> None:
        await self.servicer.enter_graceful_shutdown()  # every service NOT_SERVING, for good

    async def _set(
        self, services: list[str], status: health_pb2.HealthCheckResponse.ServingStatus
    ) -> None:
        for service in services:
            await self.servicer.set(service, status)


def health_server(services: HealthServices) -> aio.Server:
    """A plaintext gRPC server with only the health services (for Kubernetes gRPC probes)."""
    server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(services.servicer, server)
    return server
