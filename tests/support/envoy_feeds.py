"""Calls a test makes as if it were Envoy on the ext_proc's EDS and access-log services: the
pools' members asked for once, one access-log message sent; each bounded in time."""

from __future__ import annotations

import asyncio

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from grpc import aio

from extproc.membership.eds import ASSIGNMENT_TYPE

__all__ = ["REFUSED", "pool_members", "send_access_log"]

# How a port that does not serve a service refuses these streams: UNIMPLEMENTED, or, when the
# server's answer ends the stream before the client's first message is sent, that send's
# INTERNAL failure ("execute_batch"). A served call raises neither.
REFUSED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL)


async def pool_members(channel: aio.Channel, pool: str, timeout_s: float = 5) -> list[str]:
    """The members the EDS service on `channel` hands out for `pool` (raises AioRpcError when
    the service is not there)."""
    call = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints()
    try:
        request = discovery_pb2.DiscoveryRequest(type_url=ASSIGNMENT_TYPE, resource_names=[pool])
        await asyncio.wait_for(call.write(request), timeout_s)
        response = await asyncio.wait_for(call.read(), timeout_s)
        if response is aio.EOF:
            await call  # raises the call's error status
            return []
        found = []
        for resource in response.resources:
            assignment = endpoint_pb2.ClusterLoadAssignment()
            resource.Unpack(assignment)
            for locality in assignment.endpoints:
                for each in locality.lb_endpoints:
                    address = each.endpoint.address.socket_address
                    found.append(f"{address.address}:{address.port_value}")
        return found
    finally:
        call.cancel()


async def send_access_log(channel: aio.Channel, entries: int = 1, timeout_s: float = 5) -> None:
    """One access-log message of `entries` bare entries (raises AioRpcError when refused)."""
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(accesslog_pb2.HTTPAccessLogEntry() for _ in range(entries))
    stub = als_pb2_grpc.AccessLogServiceStub(channel)
    await asyncio.wait_for(stub.StreamAccessLogs(iter([message])), timeout_s)
