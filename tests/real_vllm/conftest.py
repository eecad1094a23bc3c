"""Fixtures of the `real_vllm` tests (the engines themselves: tests/support/real_vllm.py).

At most one P/D pair runs at a time (each engine is ~3.25 GB): the session-wide `EnginePool`
keeps the current pair and only restarts an engine whose spec changes. Tests are reordered so
that those needing the same pair run together (push, then push with a plain decode, then pull),
which keeps the whole suite to a handful of engine starts. The contract tests end by killing D
(vLLM's EngineCore dies on incomplete kv_transfer_params), so each runs last with its pair.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from tests.support.real_vllm import EnginePool

# push_dp follows push_contract, whose D is gone: its P and D start together, and so do the
# next kind's (P back to one rank, the plain D), so the DP pair costs about one start.
PAIR_ORDER = (
    "push",
    "push_restart",
    "push_contract",
    "push_dp",
    "push_plain_decode",
    "pull",
    "pull_contract",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pair(kind): which real engine pair a test needs")


def _pair_rank(item: pytest.Item) -> int:
    marker = item.get_closest_marker("pair")
    return PAIR_ORDER.index(marker.args[0]) if marker else len(PAIR_ORDER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests needing one pair kind run together, so the pool restarts little; other tests of
    # the session keep their order and run first.
    real = [item for item in items if item.get_closest_marker("real_vllm")]
    others = [item for item in items if not item.get_closest_marker("real_vllm")]
    items[:] = others + sorted(real, key=_pair_rank)


@pytest_asyncio.fixture(scope="session")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EnginePool]:
    engine_pool = EnginePool(tmp_path_factory.mktemp("real-vllm-logs"))
    try:
        yield engine_pool
    finally:
        await engine_pool.close()
        for name, seconds in engine_pool.start_times:
            print(f"\nreal_vllm engine start: {name} {seconds:.0f} s")


@pytest_asyncio.fixture(scope="session")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:
        yield client
