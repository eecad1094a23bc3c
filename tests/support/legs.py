"""One request's two legs as the engines saw them: which P and D records pair up, how close together
they arrived, and where D's KV came from."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp

from tests.support.engines import MODEL
from tests.support.topology import Topology
from vllmsim.launcher import EngineHandle

COMPLETION = {
    "model": MODEL,
    "prompt": "The quick brown fox " * 20,
    "max_tokens": 8,
    "temperature": 0,
}


# While a test holds P (`held_prefills`), P answers no sooner than this after a leg reaches it,
# so a D leg that reached D within it was sent before P could answer: the legs went out together
# and D's registration reached P while P was still computing (vllmsim labels it push-parallel).
# A serial dispatch puts the whole hold between them. How close together the legs leave on a
# quiet machine (a few milliseconds) is a benchmark's figure, bench/hotpath.py's dispatch skew:
# a timed assertion would fail whenever this shared host delays one process by a slice.
P_HOLD_S = 0.5


class _Session(Protocol):
    @property
    def session(self) -> aiohttp.ClientSession: ...
    @property
    def prefills(self) -> list[EngineHandle]: ...


@contextlib.asynccontextmanager
async def held_prefills(topo: _Session) -> AsyncIterator[None]:
    """Every P of `topo` answers P_HOLD_S late (a latency fault) while the block runs."""
    await _set_latency(topo, P_HOLD_S * 1000)
    try:
        yield
    finally:
        await _set_latency(topo, 0)


async def _set_latency(topo: _Session, latency_ms: float) -> None:
    for engine in topo.prefills:
        url = engine.url + "/sim/faults"
        async with topo.session.post(url, json={"latency_ms": latency_ms}) as response:
            assert response.status == 200, await response.text()


def assert_sent_together(p: dict[str, Any], d: dict[str, Any]) -> None:
    """P's and D's legs of one request reached their engines while P was held (see P_HOLD_S)."""
    assert abs(p["received_at"] - d["received_at"]) < P_HOLD_S, (p["received_at"], d["received_at"])


def by_request_id(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["x_request_id"]: r for r in records}


async def legs(topo: Topology) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(P record, D record) pairs of the user requests the engines saw, oldest first."""
    prefill_seen: dict[str, dict[str, Any]] = {}
    for engine in topo.prefills:
        prefill_seen |= by_request_id(await topo.seen(engine))
    pairs = []
    for engine in topo.decodes:
        for record in await topo.seen(engine):
            pairs.append((prefill_seen.get(record["x_request_id"]), record))
    return sorted(pairs, key=lambda pair: pair[1]["received_at"])


def assert_kv_pushed_by(d: dict[str, Any], prefill_engine_id: str) -> None:
    """D's prompt blocks were all written by a push from that P while P was still computing
    (vllmsim records where each block's content came from)."""
    assert d["kv"] == "push-parallel"
    assert list(d["kv_evidence"]["blocks"]) == ["push-parallel"]
    assert d["kv_evidence"]["engine_ids"] == [prefill_engine_id]
