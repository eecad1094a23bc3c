"""One request's two legs as the engines saw them: which P and D records pair up, how close together
they arrived, and where D's KV came from."""

from __future__ import annotations

from typing import Any

from tests.support.engines import MODEL
from tests.support.topology import Topology

COMPLETION = {
    "model": MODEL,
    "prompt": "The quick brown fox " * 20,
    "max_tokens": 8,
    "temperature": 0,
}


# One request's skew on a busy 2-core host can exceed the 5 ms target by a scheduling slice;
# the target itself is asserted on the median (tests/integration/test_dispatch.py); this bound
# catches serial dispatch.
SKEW_BOUND_S = 0.03


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
