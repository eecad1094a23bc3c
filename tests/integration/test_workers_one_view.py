"""Two ext_proc processes of one sidecar (`extproc.workers: 2`) route as one: real Envoy
spreading the streams over both, the real ext_procs sharing their load table, vllmsim engines
publishing their KV events to both.

A prefill holds a long prompt and then holds every request it is sent (hung); requests that
share the prompt keep going there, each adding its uncached tokens and 64 for the request to
the work queued there, until that work passes twice the cached tokens: then the next one goes
to the other prefill. One process spills at the same request whichever process sends it only
if each counts the other's requests too.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from extproc.testing import scrape
from tests.support.kv_routing import (
    completion_body,
    engine_flags,
    kv_endpoint,
    kv_pool,
    loopback_events,
    model_dir,
    words,
)
from tests.support.topology import MODEL, Topology, address, topology, until
from vllmsim.launcher import EngineHandle

__all__ = ["loopback_events", "model_dir"]  # the fixtures, from tests/support

SHARED = words(0, 240)  # with the BOS, 60 full blocks of 4: 240 tokens cached at the holder
# Each request adds 2 uncached tokens (the last block: the last shared word and its marker)
# and kv_request_tokens (64): the holder's 2 x 240 outweighs 7 of them (462), not 8 (528).
SPILL = 8


async def workers_serving(topo: Topology) -> None:
    """Until Envoy has given both processes streams (a worker joins the rotation at its first
    passing health check)."""
    name = "pd_extproc_processing_seconds_count"
    body = {"model": MODEL, "prompt": "warm", "max_tokens": 1}

    async def both() -> bool:
        results = await asyncio.gather(*(topo.post("/v1/completions", body) for _ in range(4)))
        assert [status for status, _, _ in results] == [200] * 4
        page = await scrape(topo.session, topo.sidecar.metrics + "/metrics")
        return all(page.get(f'{name}{{worker="{w}"}}', 0.0) for w in ("0", "1"))

    await until(both, "both ext_proc processes to serve requests", timeout_s=30)


async def indexed_by_both(topo: Topology, holder: EngineHandle) -> None:
    """Until both processes applied the holder's KV events of the shared prompt (each new
    try stores the prompt with one more word: a new batch)."""
    name = f'pd_extproc_kv_event_batches_total{{endpoint="{address(holder)}",outcome="applied"'
    tries = iter(range(1, 1000))

    async def applied() -> bool:
        page = await scrape(topo.session, topo.sidecar.metrics + "/metrics")
        if all(page.get(f'{name},worker="{w}"}}', 0.0) for w in ("0", "1")):
            return True
        body = completion_body(f"{SHARED} {words(300 + next(tries), 1)}")
        async with topo.session.post(
            holder.url + "/v1/completions",
            data=body,
            headers={"content-type": "application/json"},
        ) as response:
            assert response.status == 200, await response.text()
        return False

    await until(applied, "both processes applied the holder's KV events")


async def received(engine: EngineHandle, topo: Topology, marker: str) -> bool:
    return any(marker in json.dumps(r["body"]) for r in await topo.seen(engine))


async def in_flight_at(topo: Topology, url: str, holder: EngineHandle) -> int:
    """One process's own count at the holder (its /ready page)."""
    async with topo.session.get(url + "/ready?verbose") as response:
        ready = await response.json()
    return int(ready["prefill"][address(holder)]["in_flight"])


async def test_two_processes_spill_a_burst_sharing_a_prefix_where_one_would(
    model_dir: Path,
) -> None:
    async with topology(
        2,
        1,
        engine_flags=engine_flags(model_dir),
        endpoint=kv_endpoint,
        prefill=kv_pool(),
        decode=kv_pool(),
        tokenizer=str(model_dir),
        extproc={"workers": 2},
    ) as topo:
        await workers_serving(topo)
        holder, other = topo.prefills
        await indexed_by_both(topo, holder)
        await topo.sim(holder, "POST", "/sim/faults", {"hang_next": 100})
        held: list[asyncio.Task[object]] = []
        try:
            spill = None
            for n in range(3 * SPILL):
                marker = f"q{n:02}"
                body = completion_body(f"{SHARED} {marker}")
                task = asyncio.create_task(topo.post("/v1/completions", body))
                held.append(task)

                async def placed(marker: str = marker, task: asyncio.Task[object] = task) -> bool:
                    return task.done() or await received(holder, topo, marker)

                await until(placed, f"request {marker} placed")
                if task.done():  # not held: it went to the other prefill
                    assert await received(other, topo, marker)
                    spill = n
                    break
            assert spill == SPILL, spill
            # both processes sent the holder some: each spilled on the sum, not its share
            [worker] = topo.sidecar.worker_metrics
            counts = [
                await in_flight_at(topo, topo.sidecar.metrics, holder),
                await in_flight_at(topo, worker, holder),
            ]
            assert all(counts) and sum(counts) == SPILL, counts
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
