"""The gateway's subset hint: the endpoints one request may be routed to (endpoint-picker mode).

A Gateway API Inference Extension gateway may narrow a request to some of the pool's endpoints
by putting a list in the ext_proc request's metadata, under the namespace `envoy.lb.subset_hint`
and the key `x-gateway-destination-endpoint-subset`. The endpoint picker must then pick only
inside it, and answer 503 when nothing inside it can serve. Gateways write the list either as
a metadata list (control planes) or as one comma-separated string (a header copied into
metadata); an entry is `ip:port`, or a bare IP that admits every port of that host.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

__all__ = ["SUBSET_KEY", "SUBSET_NAMESPACE", "Subset", "subset_hint"]

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


def _host(text: str) -> str | None:
    """`text` as a normalised IP address ('::1' for '[::1]'), or None when it is not one."""
    try:
        return str(ipaddress.ip_address(text.removeprefix("[").removesuffix("]")))
    except ValueError:
        return None


def _split(address: str) -> tuple[str | None, str | None]:
    """(normalised host, port or None) of 'ip:port', '[v6]:port', 'ip' or 'v6'."""
    if (host := _host(address)) is not None:
        return host, None  # a bare address: every port
    host_text, _, port = address.rpartition(":")
    return _host(host_text), port if port.isdigit() else None


@dataclass(frozen=True, slots=True)
class Subset:
    """The endpoints a gateway allows for one request."""

    endpoints: frozenset[tuple[str, str]]  # (host, port)
    hosts: frozenset[str]  # bare hosts: any port
    listed: int  # entries the gateway sent, for the 503's message

    @classmethod
    def of(cls, entries: Iterable[str]) -> Subset:
        endpoints, hosts, listed = set(), set(), 0
        for entry in entries:
            listed += 1
            host, port = _split(entry.strip())
            if host is None:
                continue  # not an IP address: it can match no endpoint
            if port is None:
                hosts.add(host)
            else:
                endpoints.add((host, port))
        return cls(frozenset(endpoints), frozenset(hosts), listed)

    def admits(self, address: str) -> bool:
        host, port = _split(address)
        return host is not None and (host in self.hosts or (host, port or "") in self.endpoints)

    def restrict(self, members: Collection[str]) -> set[str]:
        return {address for address in members if self.admits(address)}


def _entries(value: struct_pb2.Value) -> list[str]:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return [part for part in value.string_value.split(",") if part.strip()]
    if kind == "list_value":
        return [part for item in value.list_value.values for part in _entries(item)]
    return []  # any other type lists nothing: nothing in it can serve


def subset_hint(message: ep.ProcessingRequest, namespace: str = SUBSET_NAMESPACE) -> Subset | None:
    """The subset the gateway sent with this request; None when it sent none (the whole pool)."""
    metadata = message.metadata_context.filter_metadata
    if namespace not in metadata:
        return None
    fields = metadata[namespace].fields
    if SUBSET_KEY not in fields:
        return None
    return Subset.of(_entries(fields[SUBSET_KEY]))
