"""Pool membership for Envoy over gRPC EDS, served by the ext_proc beside its ExternalProcessor.

Envoy's decode_pool and prefill_pool clusters subscribe to their endpoints through the ext_proc's
own cluster (state-of-the-world xDS; one stream may carry both). Whatever the ext_proc's
discovery finds (static lists, DNS, Kubernetes, a reload) is pushed at once to every subscribed
Envoy, so Envoy can only route to the endpoints the ext_proc picks from, in every mode.

Versions are derived from the content, never counted: every ext_proc process holding the same
members serves the same version, so an Envoy whose stream moves to another worker or to a
restarted ext_proc sees no change. While no stream is up, Envoy keeps the endpoints it has.
The incremental protocol (DeltaEndpoints) is not served: it answers UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from envoy.config.core.v3 import address_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2 as components
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from grpc import aio

from extproc.config import parse_host_port
from extproc.metrics import Metrics
from extproc.roles import Role

__all__ = ["ASSIGNMENT_TYPE", "EndpointDiscovery", "Memberships", "pool_cluster_name"]

log = logging.getLogger("extproc.membership.eds")

ASSIGNMENT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
# A response is a few hundred bytes: an Envoy that takes none for this long is stuck; ending
# its stream makes it open a new one.
_WRITE_TIMEOUT_S = 10.0


def pool_cluster_name(role: Role) -> str:
    """The Envoy cluster (and EDS resource) of a role's pool."""
    return f"{role}_pool"


def _lb_endpoint(member: str) -> components.LbEndpoint:
    host, port = parse_host_port(member)
    socket = address_pb2.SocketAddress(address=host, port_value=port)
    endpoint = components.Endpoint(address=address_pb2.Address(socket_address=socket))
    return components.LbEndpoint(endpoint=endpoint)


def assignment(cluster: str, members: Iterable[str]) -> endpoint_pb2.ClusterLoadAssignment:
    lb_endpoints = [_lb_endpoint(m) for m in members]
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster, endpoints=[components.LocalityLbEndpoints(lb_endpoints=lb_endpoints)]
    )


class Memberships:
    """Each pool cluster's current members; wakes every EDS stream when one changes."""

    def __init__(self) -> None:
        self._members: dict[str, tuple[str, ...]] = {}
        self._listeners: set[asyncio.Queue[object]] = set()

    def publish(self, cluster: str, members: Iterable[str]) -> None:
        """Set `cluster`'s members (sorted: same members, same answer in every process)."""
        new = tuple(sorted(set(members)))
        if self._members.get(cluster) == new:
            return
        self._members[cluster] = new
        for inbox in self._listeners:
            inbox.put_nowait(_CHANGED)

    def get(self, cluster: str) -> tuple[str, ...] | None:
        return self._members.get(cluster)

    @contextlib.contextmanager
    def listen(self, inbox: asyncio.Queue[object]) -> Iterator[None]:
        """While open, `inbox` receives a marker after every change."""
        self._listeners.add(inbox)
        try:
            yield
        finally:
            self._listeners.discard(inbox)


_CHANGED = object()  # a membership changed
_ENDED = object()  # Envoy closed its side, or the ext_proc is shutting down


class _EdsStream:
    """One Envoy's SotW subscription: answer its first request and every change of the names
    it asks for, ignore ACKs and requests that answer an older response (a newer one is on its
    way), and log a NACK without resending what was refused."""

    def __init__(
        self, memberships: Memberships, context: aio.ServicerContext[Any, Any], metrics: Metrics
    ) -> None:
        self._memberships = memberships
        self._context = context
        self._metrics = metrics
        self._names: tuple[str, ...] | None = None  # None until the first request
        self._sent: dict[str, tuple[str, ...]] = {}  # what this Envoy was last sent
        self._nonce = 0
        self._peer = context.peer()

    async def run(self, inbox: asyncio.Queue[object]) -> None:
        reader = asyncio.create_task(self._read(inbox))
        try:
            with self._memberships.listen(inbox):
                # No timeout: an xDS stream lives as long as Envoy or this process; close()
                # and Envoy's end of stream both arrive here as _ENDED.
                while (item := await inbox.get()) is not _ENDED:
                    if item is _CHANGED:
                        await self._push_changes()
                    else:
                        await self._on_request(item)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self, inbox: asyncio.Queue[object]) -> None:
        try:
            while (request := await self._context.read()) is not aio.EOF:
                inbox.put_nowait(request)
        finally:
            inbox.put_nowait(_ENDED)

    async def _on_request(self, request: discovery_pb2.DiscoveryRequest) -> None:
        if request.type_url and request.type_url != ASSIGNMENT_TYPE:
            log.warning("EDS from %s: unexpected type %s ignored", self._peer, request.type_url)
            return
        if request.response_nonce and request.response_nonce != str(self._nonce):
            return  # answers an older response; the newest one is on its way
        if request.HasField("error_detail"):
            self._metrics.eds_responses.labels("rejected").inc()
            log.warning(
                "Envoy %s rejected endpoints version %s: %s",
                self._peer,
                request.version_info,
                request.error_detail.message,
            )
        names = tuple(sorted(request.resource_names))
        if names != self._names:  # the first request, or a changed subscription
            self._names = names
            log.info("Envoy %s subscribed to the endpoints of %s", self._peer, ", ".join(names))
            for unknown in (n for n in names if self._memberships.get(n) is None):
                log.warning(
                    "Envoy %s asked for the endpoints of %s: not a pool", self._peer, unknown
                )
            await self._send()

    async def _push_changes(self) -> None:
        if self._names is not None and any(
            self._memberships.get(n) != self._sent.get(n) for n in self._names
        ):
            await self._send()

    async def _send(self) -> None:
        assert self._names is not None
        current = {n: m for n in self._names if (m := self._memberships.get(n)) is not None}
        resources = [assignment(name, members) for name, members in current.items()]
        self._nonce += 1
        response = discovery_pb2.DiscoveryResponse(
            version_info=_version(resources), type_url=ASSIGNMENT_TYPE, nonce=str(self._nonce)
        )
        for resource in resources:
            response.resources.add().Pack(resource)
        self._sent = current
        async with asyncio.timeout(_WRITE_TIMEOUT_S):
            await self._context.write(response)
        self._metrics.eds_responses.labels("sent").inc()


def _version(resources: list[endpoint_pb2.ClusterLoadAssignment]) -> str:
    digest = hashlib.sha256()
    for resource in resources:
        digest.update(resource.SerializeToString(deterministic=True))
    return digest.hexdigest()[:16]


class EndpointDiscovery(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    """The EDS gRPC service; `close()` ends every open stream (Envoy keeps its endpoints)."""

    def __init__(self, memberships: Memberships, metrics: Metrics) -> None:
        self._memberships = memberships
        self._metrics = metrics
        self._inboxes: set[asyncio.Queue[object]] = set()
        self._closed = False

    async def StreamEndpoints(self, request_iterator: Any, context: aio.ServicerContext) -> None:
        if self._closed:
            return
        inbox: asyncio.Queue[object] = asyncio.Queue()
        self._inboxes.add(inbox)
        try:
            with self._metrics.eds_streams.track_inprogress():
                await _EdsStream(self._memberships, context, self._metrics).run(inbox)
        except TimeoutError:
            log.warning(
                "EDS: Envoy %s took no answer for %g s; stream ended",
                context.peer(),
                _WRITE_TIMEOUT_S,
            )
        finally:
            self._inboxes.discard(inbox)

    async def DeltaEndpoints(self, request_iterator: Any, context: aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "pd-extproc serves EDS state of the world only: api_type GRPC, not DELTA_GRPC",
        )

    def close(self) -> None:
        self._closed = True
        for inbox in self._inboxes:
            inbox.put_nowait(_ENDED)
