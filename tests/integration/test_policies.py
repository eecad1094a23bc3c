"""Picking policies end to end: real Envoy, the real ext_proc, 2P2D vllmsim engines.

Which engine served a request is read from the engines' own request logs (GET /sim/requests);
each test's prompts carry a marker ("session 3", "group 7") that names what it belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from tests.integration.conftest import MODEL, Topology, address, topology
from vllmsim.testing import FAST, EngineHandle

FILLER = "The history of the lighthouse keepers on the northern coast is long. " * 6
MARKER = re.compile(r"(session|group) (\d+)")


def prompt_text(record: dict[str, Any]) -> str:
    body = record["body"] or {}
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


async def served_by(topo: Topology, engines: Iterable[EngineHandle]) -> dict[str, set[str]]:
    """marker ("session 3") → addresses of the engines that received its requests."""
    where: dict[str, set[str]] = defaultdict(set)
    for engine in engines:
        for record in await topo.seen(engine):
            if match := MARKER.search(prompt_text(record)):
                where[match.group(0)].add(address(engine))
    return where


async def completion(topo: Topology, prompt: str, **headers: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, text, _ = await topo.post("/v1/completions", body, headers=headers)
    assert status == 200, text


async def chat(topo: Topology, system: str, question: str) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    status, text, _ = await topo.post("/v1/chat/completions", body)
    assert status == 200, text


async def test_session_sticks_to_one_prefill_and_one_decode() -> None:
    policy = {"policy": "session"}
    async with topology(2, 2, engine_flags=FAST, prefill=policy, decode=policy) as topo:
        for turn in range(3):  # interleaved turns, as concurrent conversations arrive
            for k in range(12):
                prompt = f"session {k} turn {turn}: {FILLER}"
                await completion(topo, prompt, **{"x-session-id": f"conversation-{k}"})
        for engines in (topo.prefills, topo.decodes):
            where = await served_by(topo, engines)
            assert len(where) == 12
            assert all(len(addresses) == 1 for addresses in where.values()), where
            # 12 conversations on one engine of two: probability 2/4096
            assert len(set().union(*where.values())) == 2, where


async def test_requests_without_session_header_are_spread() -> None:
    policy = {"policy": "session"}
    async with topology(2, 2, engine_flags=FAST, decode=policy) as topo:
        for k in range(8):
            await completion(topo, f"session {k}: {FILLER}")
        where = await served_by(topo, topo.decodes)
        assert len(set().union(*where.values())) == 2  # least_request fallback, not one hash


async def test_prefix_affinity_on_prefill() -> None:
    async with topology(2, 2, engine_flags=FAST, prefill={"policy": "prefix"}) as topo:
        for i in range(3):
            for g in range(11):  # odd: round robin sends a group's next request elsewhere
                shared = f"group {g}. {FILLER}"  # > 256 bytes shared; the question differs
                if g % 2:
                    await chat(topo, shared, f"question {i}")
                else:
                    await completion(topo, f"{shared} question {i}")
        prefill = await served_by(topo, topo.prefills)
        assert len(prefill) == 11
        assert all(len(addresses) == 1 for addresses in prefill.values()), prefill
        assert len(set().union(*prefill.values())) == 2, prefill  # all on one: p = 2/2048
        decode = await served_by(topo, topo.decodes)  # round robin there: no affinity
        assert all(len(addresses) == 2 for addresses in decode.values()), decode


async def busy(topo: Topology, engine: EngineHandle) -> None:
    """A long request sent straight to the engine, as another router would."""
    body = {"model": MODEL, "prompt": "elsewhere", "max_tokens": 3000, "temperature": 0}
    async with topo.session.post(engine.url + "/v1/completions", json=body) as response:
        await response.read()


async def test_power_of_two_avoids_the_engine_with_a_queue() -> None:
    decode = {"policy": "power_of_two", "load_interval_s": 0.2}
    flags = (*FAST, "--max-num-seqs", "1")  # one at a time: the rest wait, as the metric shows
    async with topology(2, 2, engine_flags=flags, decode=decode) as topo:
        loaded, idle = topo.decodes
        others = [asyncio.create_task(busy(topo, loaded)) for _ in range(4)]
        try:
            await asyncio.sleep(1.0)  # several scrapes of the engines' num_requests_waiting
            for k in range(10):
                await completion(topo, f"session {k}: {FILLER}")
            where = await served_by(topo, topo.decodes)
        finally:
            for task in others:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*others, return_exceptions=True)
        assert len(where) == 10
        assert all(addresses == {address(idle)} for addresses in where.values()), where
