"""The gateway's subset hint as the picker reads it: a comma-separated string or a list, IPv4
and bracketed IPv6 entries with or without a port, and the entries it cannot use."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc.scheduling.subset_hint import SUBSET_KEY, SUBSET_NAMESPACE, Subset, subset_hint


def hinted(value: struct_pb2.Value) -> ep.ProcessingRequest:
    message = ep.ProcessingRequest()
    message.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY].CopyFrom(value)
    return message


def test_a_comma_separated_string_lists_each_endpoint() -> None:
    listed = "10.0.0.1:8000,10.0.0.2:8000, 10.0.0.3:8001"
    subset = subset_hint(hinted(struct_pb2.Value(string_value=listed)))
    assert subset is not None
    assert subset.listed == 3
    assert subset.restrict(["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]) == {
        "10.0.0.1:8000",
        "10.0.0.2:8000",
    }


def test_a_bracketed_ipv6_entry_admits_that_endpoint_only() -> None:
    subset = Subset.of(["[::1]:8000"])
    assert subset.admits("[::1]:8000")
    assert not subset.admits("[::1]:8001")


def test_a_bare_address_admits_every_port_of_its_host() -> None:
    subset = Subset.of(["10.0.0.2", "[fd00::2]"])
    assert subset.restrict(["10.0.0.2:9000", "[fd00::2]:8000", "10.0.0.3:9000"]) == {
        "10.0.0.2:9000",
        "[fd00::2]:8000",
    }


def test_an_entry_without_a_numeric_port_is_taken_as_its_host() -> None:
    assert Subset.of(["10.0.0.1:"]).admits("10.0.0.1:8000")


def test_an_entry_that_is_no_address_is_counted_and_skipped() -> None:
    subset = Subset.of(["engine-0.pool:8000", "10.0.0.1:8000", "not an address"])
    assert subset.listed == 3  # the 503 says how many the gateway sent
    assert subset.restrict(["10.0.0.1:8000", "10.0.0.9:8000"]) == {"10.0.0.1:8000"}
