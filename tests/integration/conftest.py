"""Fixtures of the integration tests (the topologies themselves: tests/support/topology.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from tests.support.topology import Topology, topology


@pytest_asyncio.fixture(scope="module")
async def push_1p1d() -> AsyncIterator[Topology]:
    async with topology() as topo:
        yield topo
