"""kv_cache with no KV events and no tokenizer, end to end (real Envoy, the real ext_proc,
vllmsim engines that publish nothing): the sidecar routes a prompt by what it sent each engine
of it, its raw bytes, within the kv_cache policy's load bound.

Where a test needs "the engine prompt-start hashing would not pick", it asks the fallback
itself (`fallback_choice`, which hashes this run's ports), so the assertion is certain.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from extproc.request.parse import Api
from tests.support.kv_routing import completion_body, fallback_choice
from tests.support.topology import Topology, address, topology, until

SHARED = " ".join(f"word{i}" for i in range(24))  # under prompt-start hashing's 256 bytes


@pytest.fixture(params=["stated", "default"])
async def topo_2p1d(request: pytest.FixtureRequest) -> AsyncIterator[Topology]:
    """kv_cache named in the config, or left to the default (a config naming no policy)."""
    if request.param == "stated":
        routing = topology(2, 1, prefill={"policy": "kv_cache"})
    else:
        routing = topology(2, 1, default_policy=True)
    async with routing as topo:
        yield topo


async def served(topo: Topology, marker: str) -> list[str]:
    """The prefills whose request log has a request containing `marker`."""
    return [
        address(p)
        for p in topo.prefills
        if any(marker in json.dumps(r["body"]) for r in await topo.seen(p))
    ]


def hashed_apart(prefix: str, topo: Topology) -> tuple[bytes, bytes]:
    """Two prompts that share `prefix` (whole blocks of it) and that hashing sends apart."""
    first = completion_body(f"{prefix} mk-first")
    for n in range(200):
        second = completion_body(f"{prefix} mk-again{n}")
        if fallback_choice(topo.prefills, Api.COMPLETIONS, second) != fallback_choice(
            topo.prefills, Api.COMPLETIONS, first
        ):
            return first, second
    raise AssertionError("no two prompts hashed apart")


async def test_a_repeated_prefix_goes_to_the_prefill_it_went_to_before(
    topo_2p1d: Topology,
) -> None:
    topo = topo_2p1d
    engines = [address(p) for p in topo.prefills]
    first, second = hashed_apart(SHARED, topo)
    status, text, _ = await topo.post("/v1/completions", first)
    assert status == 200, text
    [holder] = await served(topo, "mk-first")
    assert holder == fallback_choice(topo.prefills, Api.COMPLETIONS, first)  # new: hashed

    status, text, _ = await topo.post("/v1/completions", second)
    assert status == 200, text
    assert await served(topo, "mk-again") == [holder]  # not where hashing sends it

    # a distinct prefix is new everywhere: hashed, here to the other prefill
    other = next(
        body
        for n in range(200)
        if fallback_choice(
            topo.prefills, Api.COMPLETIONS, body := completion_body(f"fresh{n} start mk-new")
        )
        != holder
    )
    status, text, _ = await topo.post("/v1/completions", other)
    assert status == 200, text
    assert await served(topo, "mk-new") == [next(e for e in engines if e != holder)]


async def test_a_repeated_prefix_spills_once_the_work_queued_there_outweighs_it(
    topo_2p1d: Topology,
) -> None:
    """A 2 KiB prompt (16 blocks, ~512 tokens at 4 bytes a token) went to one prefill, which
    then holds every request it is sent (hung): those sharing the prompt keep going there, each
    adding 2 uncached tokens and 64 for the request, until that work passes twice the 512
    cached (2 × 512 − 16 × 66 < 0): the 17th goes to the other prefill. Prompt-start hashing
    alone would spill the 4th (its bound on in-flight requests)."""
    topo = topo_2p1d
    long_prefix = "x" * (2048 - len('"prompt":"'))  # the member's first 16 blocks
    status, text, _ = await topo.post("/v1/completions", completion_body(f"{long_prefix} q-0"))
    assert status == 200, text
    [holder] = await served(topo, "q-0")
    holding = topo.engines_by_address[holder]
    await topo.sim(holding, "POST", "/sim/faults", {"hang_next": 100})
    hung: list[asyncio.Task[object]] = []
    try:
        spill = None
        for n in range(24):
            task = asyncio.create_task(
                topo.post("/v1/completions", completion_body(f"{long_prefix} q{n:02}"))
            )
            hung.append(task)

            async def placed(n: int = n, task: asyncio.Task[object] = hung[-1]) -> bool:
                in_flight = (await topo.ready())["prefill"][holder]["in_flight"]
                return task.done() or in_flight == n + 1

            await until(placed, f"request {n} placed")
            if task.done():  # not held: it went elsewhere
                spill = n
                break
        assert spill is not None, "never spilled"
        assert await served(topo, f"q{spill:02}") == [
            address(p) for p in topo.prefills if address(p) != holder
        ]
        assert 12 <= spill <= 16, spill  # 16 by the formula; a scrape may add some load
    finally:
        for task in hung:
            task.cancel()
        await asyncio.gather(*hung, return_exceptions=True)
