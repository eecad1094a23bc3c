"""The EDS service over a real gRPC connection: the state-of-the-world protocol as Envoy speaks
it (first answer, ACK, NACK, stale nonces, several clusters on one stream), pushes on every
membership change, versions that depend on the content only, and streams ended on close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import pytest_asyncio
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.rpc import status_pb2
from grpc import aio

from extproc.membership.eds import ASSIGNMENT_TYPE, EndpointDiscovery, Memberships
from extproc.metrics import Metrics

READ_TIMEOUT_S = 5


@dataclass
class Served:
    memberships: Memberships
    service: EndpointDiscovery
    stub: Any
    metrics: Metrics

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    memberships = Memberships()
    memberships.publish("decode_pool", ["10.0.0.2:8000", "10.0.0.1:8000"])
    memberships.publish("prefill_pool", ["10.0.0.9:8000"])
    metrics = Metrics()
    service = EndpointDiscovery(memberships, metrics)
    server = aio.server()
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel)
        yield Served(memberships, service, stub, metrics)
    finally:
        await channel.close()
        service.close()
        await server.stop(1)


def request(
    *names: str, version: str = "", nonce: str = "", error: str | None = None
) -> discovery_pb2.DiscoveryRequest:
    message = discovery_pb2.DiscoveryRequest(
        type_url=ASSIGNMENT_TYPE, resource_names=names, version_info=version, response_nonce=nonce
    )
    if error is not None:
        message.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return message


async def answer(call: Any) -> discovery_pb2.DiscoveryResponse:
    response = await asyncio.wait_for(call.read(), READ_TIMEOUT_S)
    assert response is not aio.EOF
    assert response.type_url == ASSIGNMENT_TYPE
    return response


def members(response: discovery_pb2.DiscoveryResponse) -> dict[str, list[str]]:
    found = {}
    for resource in response.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert resource.Unpack(cla)
        found[cla.cluster_name] = [
            f"{e.endpoint.address.socket_address.address}:"
            f"{e.endpoint.address.socket_address.port_value}"
            for locality in cla.endpoints
            for e in locality.lb_endpoints
        ]
    return found


async def ack(call: Any, response: discovery_pb2.DiscoveryResponse, *names: str) -> None:
    await call.write(request(*names, version=response.version_info, nonce=response.nonce))


async def test_first_request_is_answered_and_an_ack_is_not(served: Served) -> None:
    call = served.stub.StreamEndpoints()
    await call.write(request("decode_pool"))
    first = await answer(call)
    assert members(first) == {"decode_pool": ["10.0.0.1:8000", "10.0.0.2:8000"]}
    assert first.version_info and first.nonce
    assert served.sample("pd_extproc_eds_streams") == 1
    await ack(call, first, "decode_pool")
    served.memberships.publish("decode_pool", ["10.0.0.1:8000"])
    # the next message is the change: the ACK itself got no answer
    second = await answer(call)
    assert members(second) == {"decode_pool": ["10.0.0.1:8000"]}
    assert second.nonce != first.nonce and second.version_info != first.version_info
    assert served.sample("pd_extproc_eds_responses_total", outcome="sent") == 2
    call.cancel()


async def test_two_clusters_on_one_stream(served: Served) -> None:
    call = served.stub.StreamEndpoints()
    await call.write(request("decode_pool", "prefill_pool"))
    first = await answer(call)
    assert members(first) == {
        "decode_pool": ["10.0.0.1:8000", "10.0.0.2:8000"],
        "prefill_pool": ["10.0.0.9:8000"],
    }
    await ack(call, first, "decode_pool", "prefill_pool")
    served.memberships.publish("prefill_pool", ["10.0.0.9:8000", "10.0.0.8:8000"])
    second = await answer(call)  # the whole state of both: Envoy reads each resource it names
    assert members(second) == {
        "decode_pool": ["10.0.0.1:8000", "10.0.0.2:8000"],
        "prefill_pool": ["10.0.0.8:8000", "10.0.0.9:8000"],
    }
    call.cancel()


async def test_a_change_to_a_cluster_not_subscribed_is_not_pushed(served: Served) -> None:
    call = served.stub.StreamEndpoints()
    await call.write(request("decode_pool"))
    first = await answer(call)
    await ack(call, first, "decode_pool")
    served.memberships.publish("prefill_pool", ["10.0.0.7:8000"])
    served.memberships.publish("decode_pool", ["10.0.0.3:8000"])
    assert members(await answer(call)) == {"decode_pool": ["10.0.0.3:8000"]}
    call.cancel()


async def test_a_subscription_that_grows_is_answered(served: Served) -> None:
    call = served.stub.StreamEndpoints()
    await call.write(request("decode_pool"))
    first = await answer(call)
    await call.write(
        request("decode_pool", "prefill_pool", version=first.version_info, nonce=first.nonce)
    )
    assert set(members(await answer(call))) == {"decode_pool", "prefill_pool"}
    call.cancel()


async def test_a_nack_is_logged_not_resent_and_the_next_change_still_pushed(
    served: Served,
) -> None:
    nacked = asyncio.Event()

    class NackSeen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "rejected" in record.getMessage() and "bad endpoint" in record.getMessage():
                nacked.set()

    handler = NackSeen()
    logging.getLogger("extproc.membership.eds").addHandler(handler)
    try:
        call = served.stub.StreamEndpoints()
        await call.write(request("decode_pool"))
        first = await answer(call)
        await call.write(request("decode_pool", nonce=first.nonce, error="bad endpoint"))
        await asyncio.wait_for(nacked.wait(), READ_TIMEOUT_S)  # the service has read the NACK
        served.memberships.publish("decode_pool", ["10.0.0.5:8000"])
        second = await answer(call)  # not the refused version again: the change
        assert members(second) == {"decode_pool": ["10.0.0.5:8000"]}
        assert served.sample("pd_extproc_eds_responses_total", outcome="rejected") == 1
        call.cancel()
    finally:
        logging.getLogger("extproc.membership.eds").removeHandler(handler)


async def test_a_request_answering_an_older_response_is_ignored(served: Served) -> None:
    call = served.stub.StreamEndpoints()
    await call.write(request("decode_pool"))
    first = await answer(call)
    served.memberships.publish("decode_pool", ["10.0.0.4:8000"])
    second = await answer(call)
    # Envoy's ACK of the first response arrives after the second was sent, and asks for more
    await call.write(
        request("decode_pool", "prefill_pool", version=first.version_info, nonce=first.nonce)
    )
    await ack(call, second, "decode_pool")
    served.memberships.publish("decode_pool", ["10.0.0.6:8000"])
    assert members(await answer(call)) == {"decode_pool": ["10.0.0.6:8000"]}
    call.cancel()


async def test_versions_depend_on_the_members_only(served: Served) -> None:
    """Two ext_proc processes with the same members serve the same version, and a membership
    that comes back gets its old version again."""
    other = Memberships()
    other.publish("decode_pool", ["10.0.0.1:8000", "10.0.0.2:8000"])  # another order
    other.publish("prefill_pool", ["10.0.0.9:8000"])
    service = EndpointDiscovery(other, Metrics())
    server = aio.server()
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            theirs = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints()
            await theirs.write(request("decode_pool"))
            ours = served.stub.StreamEndpoints()
            await ours.write(request("decode_pool"))
            first = await answer(ours)
            assert (await answer(theirs)).version_info == first.version_info
            theirs.cancel()
    finally:
        service.close()
        await server.stop(1)
    await ack(ours, first, "decode_pool")
    served.memberships.publish("decode_pool", ["10.0.0.1:8000"])
    changed = await answer(ours)
    await ack(ours, changed, "decode_pool")
    served.memberships.publish("decode_pool", ["10.0.0.2:8000", "10.0.0.1:8000"])
    back = await answer(ours)
    assert back.version_info == first.version_info != changed.version_info
    ours.cancel()


async def test_unknown_cluster_names_are_left_out(served: Served) -> None:
    call = served.stub.StreamEndpoints()
    await call.write(request("decode_pool", "nobody_pool"))
    assert set(members(await answer(call))) == {"decode_pool"}
    call.cancel()


async def test_close_ends_every_stream(served: Served) -> None:
    call = served.stub.StreamEndpoints()
    await call.write(request("decode_pool"))
    await answer(call)
    served.service.close()
    assert await asyncio.wait_for(call.read(), READ_TIMEOUT_S) is aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert served.sample("pd_extproc_eds_streams") == 0  # the stream ended on the server too


async def test_delta_protocol_is_unimplemented(served: Served) -> None:
    call = served.stub.DeltaEndpoints()
    with pytest.raises(aio.AioRpcError) as error:  # the write may already see the end
        await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=ASSIGNMENT_TYPE))
        await asyncio.wait_for(call.read(), READ_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "DELTA_GRPC" in (error.value.details() or "")
