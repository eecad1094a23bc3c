"""The lab's cluster: its topology's engines and their addresses."""

from __future__ import annotations

import pytest

from lab.engines import Cluster, Topology, parse_topology


def test_a_topology_is_x_prefill_and_y_decode_engines() -> None:
    assert parse_topology("2P3D") == Topology(2, 3)
    assert parse_topology("32p32d") == Topology(32, 32)
    assert Cluster.addresses(Topology(2, 1)) == {
        "prefill": ["192.0.2.1:8000", "192.0.2.2:8000"],
        "decode": ["198.51.100.1:8000"],
    }


@pytest.mark.parametrize("text", ["2P", "P2D", "0P1D", "2P0D", "1D1P", "xPyD", "255P1D"])
def test_a_topology_that_is_not_xpyd_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--topology"):
        parse_topology(text)
