"""Picking policies end to end: real Envoy, the real ext_proc, 2P2D vllmsim engines.

Which engine served a request is read from the engines' own request logs (GET /sim/requests);
each test's prompts carry a marker ("session 3", "group 7") that names what it belongs to.
The engines' ports are new on every run and the hashing policies hash them, so the sessions and
prompt groups are chosen for this run's ports with the policy itself: the spread the tests
assert is then certain, not a 1-in-1000 chance.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import orjson

from extproc.policies import Picker, PickRequest, PrefixPicker, SessionPicker
from extproc.request.parse import Api, parse_request
from extproc.request.plan import pick_request
from extproc.scheduling.pool import EndpointState
from tests.support.engines import MODEL, address
from tests.support.polling import until
from tests.support.topology import Topology, topology
from vllmsim.launcher import FAST, EngineHandle

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


def completion_body(prompt: str) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})


def chat_body(system: str, question: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0})


async def completion(topo: Topology, prompt: str, **headers: str) -> None:
    status, text, _ = await topo.post("/v1/completions", completion_body(prompt), headers=headers)
    assert status == 200, text


def choice(picker: Picker, engines: list[EngineHandle], request: PickRequest) -> str:
    """The engine `picker` gives `request` when all are idle (as for one request at a time)."""
    return picker.pick([EndpointState(address(e)) for e in engines], request).address


def first_spread(count: int, places: dict[int, tuple[str, ...]]) -> range:
    """The first `count` consecutive keys whose places (one per pool) use every engine."""
    for start in range(len(places) - count + 1):
        keys = range(start, start + count)
        if all(len({places[k][pool] for k in keys}) == 2 for pool in range(len(places[0]))):
            return keys
    raise AssertionError("no run of keys spreads over both engines")


async def test_session_sticks_to_one_prefill_and_one_decode() -> None:
    policy = {"policy": "session"}
    async with topology(2, 2, engine_flags=FAST, prefill=policy, decode=policy) as topo:
        places = {
            k: tuple(
                choice(SessionPicker(), engines, PickRequest(session=f"c-{k}"))
                for engines in (topo.prefills, topo.decodes)
            )
            for k in range(100)
        }
        sessions = first_spread(12, places)
        for turn in range(3):  # interleaved turns, as concurrent conversations arrive
            for k in sessions:
                prompt = f"session {k} turn {turn}: {FILLER}"
                await completion(topo, prompt, **{"x-session-id": f"c-{k}"})
        for pool, engines in enumerate((topo.prefills, topo.decodes)):
            where = await served_by(topo, engines)
            assert where == {f"session {k}": {places[k][pool]} for k in sessions}, where
            assert len(set().union(*where.values())) == 2, where


async def test_requests_without_session_header_are_spread() -> None:
    policy = {"policy": "session"}
    async with topology(2, 2, engine_flags=FAST, decode=policy) as topo:
        for k in range(8):
            await completion(topo, f"session {k}: {FILLER}")
        where = await served_by(topo, topo.decodes)
        assert len(set().union(*where.values())) == 2  # least_request fallback, not one hash


def group_request(g: int, i: int) -> tuple[Api, bytes]:
    """Group g's i-th request: > 256 bytes shared within the group; the question differs."""
    shared = f"group {g}. {FILLER}"
    if g % 2:
        return Api.CHAT, chat_body(shared, f"question {i}")
    return Api.COMPLETIONS, completion_body(f"{shared} question {i}")


async def test_prefix_affinity_on_prefill() -> None:
    async with topology(2, 2, engine_flags=FAST, prefill={"policy": "prefix"}) as topo:
        places: dict[int, tuple[str, ...]] = {}
        for g in range(100):  # where the sidecar's own key for the body sends each group
            wanted = pick_request(parse_request(*group_request(g, 0), 1 << 20), None)
            places[g] = (choice(PrefixPicker(), topo.prefills, wanted),)
        groups = first_spread(11, places)  # odd: round robin would move a group's next request
        for i in range(3):
            for g in groups:
                api, raw = group_request(g, i)
                status, text, _ = await topo.post(api.value, raw)
                assert status == 200, text
        prefill = await served_by(topo, topo.prefills)
        assert prefill == {f"group {g}": {places[g][0]} for g in groups}, prefill
        assert len(set().union(*prefill.values())) == 2, prefill
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

            async def queue_seen() -> bool:  # the sidecar scraped num_requests_waiting
                return (await topo.ready())["decode"][address(loaded)]["waiting"] >= 1

            await until(queue_seen, "the loaded engine's queue in the sidecar's view")
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
