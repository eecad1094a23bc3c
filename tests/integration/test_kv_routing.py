"""Routing by the engines' KV caches, end to end: real Envoy, the real ext_proc, vllmsim engines
with a prefix cache publishing vLLM's KV events, and one tokenizer for both sides.

The tokenizer is made here (a word-level one: one token a word, a BOS first), so the suite needs
no model download. Where a test needs "the engine the fallback would not pick", it asks the
fallback itself (`PrefixPicker`, which hashes this run's ports), so the assertion is certain.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.request.parse import Api
from tests.support.kv_routing import (
    BLOCK,
    completion_body,
    engine_flags,
    fallback_choice,
    kv_endpoint,
    kv_pool,
    loopback_events,
    model_dir,
    words,
)
from tests.support.topology import MODEL, PUSH, Topology, address, topology, until
from vllmsim.launcher import FAST, EngineHandle, running_engine

__all__ = ["loopback_events", "model_dir"]  # the fixtures, from tests/support


@pytest.fixture
async def topo_2p2d(model_dir: Path) -> AsyncIterator[Topology]:
    async with topology(
        2,
        2,
        engine_flags=engine_flags(model_dir),
        endpoint=kv_endpoint,
        prefill=kv_pool(),
        decode=kv_pool(),
        tokenizer=str(model_dir),
        decision={"mode": "load_aware", "pd_overhead_ms": 0},
    ) as topo:
        yield topo


async def direct(topo: Topology, engine: EngineHandle, path: str, body: bytes) -> dict[str, Any]:
    """A request sent to the engine itself (as another router would): it fills its cache."""
    async with topo.session.post(
        engine.url + path, data=body, headers={"content-type": "application/json"}
    ) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


async def metric(topo: Topology, name: str) -> float:
    return (await topo.metrics()).get(name, 0.0)


async def served(topo: Topology, engines: list[EngineHandle], marker: str) -> list[str]:
    """Addresses of the engines whose request log has a request containing `marker`."""
    return [
        address(e)
        for e in engines
        if any(marker in json.dumps(r["body"]) for r in await topo.seen(e))
    ]


async def held_by_index(topo: Topology, engine: EngineHandle, at_least: int = 1) -> None:
    """Wait until the sidecar has applied `at_least` of the engine's event batches."""
    name = f'pd_extproc_kv_event_batches_total{{endpoint="{address(engine)}",outcome="applied"}}'

    async def applied() -> bool:
        return await metric(topo, name) >= at_least

    await until(applied, f"KV events of {address(engine)} applied")


async def test_a_prompt_cached_on_one_prefill_goes_there(topo_2p2d: Topology) -> None:
    topo = topo_2p2d
    shared = words(0, 120)  # 30 blocks
    body = completion_body(f"{shared} marker-a w7")
    elsewhere = fallback_choice(topo.prefills, Api.COMPLETIONS, body)
    holder = next(p for p in topo.prefills if address(p) != elsewhere)
    await direct(topo, holder, "/v1/completions", completion_body(f"{shared} w1 w2 w3"))
    await held_by_index(topo, holder)

    status, text, _ = await topo.post("/v1/completions", body)
    assert status == 200, text
    assert await served(topo, topo.prefills, "marker-a") == [address(holder)]
    routed = await metric(topo, 'pd_extproc_kv_routed_prompt_tokens_total{role="prefill"}')
    cached = await metric(topo, 'pd_extproc_kv_cached_prompt_tokens_total{role="prefill"}')
    assert routed == 123 and cached == 120  # the BOS and 119 words: 30 full blocks


async def test_a_clients_long_session_id_does_not_blind_the_index(topo_2p2d: Topology) -> None:
    """vLLM tags a request's KV events with its `session_id` (or X-Session-ID), any length a
    client sends: the batch carrying it, with every other request's blocks of that engine
    step, is still applied, and the prompt it cached is routed to."""
    topo = topo_2p2d
    shared = words(200, 120)
    body = completion_body(f"{shared} marker-s w7")
    elsewhere = fallback_choice(topo.prefills, Api.COMPLETIONS, body)
    holder = next(p for p in topo.prefills if address(p) != elsewhere)
    filling = orjson.loads(completion_body(f"{shared} w1 w2 w3")) | {"session_id": "s" * 5000}
    await direct(topo, holder, "/v1/completions", orjson.dumps(filling))
    await held_by_index(topo, holder)
    status, text, _ = await topo.post("/v1/completions", body)
    assert status == 200, text
    assert await served(topo, topo.prefills, "marker-s") == [address(holder)]


async def test_the_next_turn_goes_decode_only_to_the_decode_that_holds_it(
    topo_2p2d: Topology,
) -> None:
    topo = topo_2p2d
    system = {"role": "system", "content": words(50, 200)}
    turn1 = [system, {"role": "user", "content": "w1 w2 w3"}]
    first = orjson.dumps({"model": MODEL, "messages": turn1, "max_tokens": 8, "temperature": 0})
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "w8 w9"},
        {"role": "user", "content": "marker-b w4"},
    ]
    second = orjson.dumps({"model": MODEL, "messages": turn2, "max_tokens": 4, "temperature": 0})
    # The conversation started on the decode the fallback would not pick for its next turn.
    holder = next(
        d for d in topo.decodes if address(d) != fallback_choice(topo.decodes, Api.CHAT, second)
    )
    await direct(topo, holder, "/v1/chat/completions", first)  # its first turn, served there
    await held_by_index(topo, holder)

    status, text, _ = await topo.post("/v1/chat/completions", second)
    assert status == 200, text
    assert await served(topo, topo.decodes, "marker-b") == [address(holder)]
    assert await served(topo, topo.prefills, "marker-b") == []  # D prefilled the rest alone
    decode_only = (
        'pd_extproc_dispatch_decisions_total{decision="decode_only",reason="faster_alone"}'
    )
    assert await metric(topo, decode_only) == 1


async def test_a_salted_prompt_is_credited_only_with_blocks_of_its_own_salt(
    topo_2p2d: Topology,
) -> None:
    """vLLM reuses a block only for a request of the same cache_salt: a long prompt D holds
    unsalted goes decode-only, the same prompt salted is not credited with D's blocks and is
    disaggregated; a prompt D holds under a salt goes decode-only for that salt alone."""
    topo = topo_2p2d
    long_prompt = words(100, 200)  # 50 blocks

    def body(marker: str, salt: str | None = None) -> bytes:
        doc = orjson.loads(completion_body(f"{long_prompt} {marker} w4", max_tokens=4))
        return orjson.dumps(doc if salt is None else doc | {"cache_salt": salt})

    holder = next(
        d
        for d in topo.decodes
        if address(d) != fallback_choice(topo.decodes, Api.COMPLETIONS, body("mk-plain"))
    )
    await direct(topo, holder, "/v1/completions", body("w1"))  # D holds the prompt, unsalted
    await direct(topo, holder, "/v1/completions", body("w2", salt="mine"))  # and salted
    await held_by_index(topo, holder, at_least=2)

    for marker, salt, decode_only in (
        ("mk-other", "other", False),  # vLLM would compute it all again
        ("mk-mine", "mine", True),
        ("mk-plain", None, True),
    ):
        status, text, _ = await topo.post("/v1/completions", body(marker, salt))
        assert status == 200, text
        through_p = await served(topo, topo.prefills, marker)
        assert (through_p == []) is decode_only, (marker, through_p)
        if decode_only:
            assert await served(topo, topo.decodes, marker) == [address(holder)]
    decisions = await topo.metrics()
    assert (
        decisions.get(
            'pd_extproc_dispatch_decisions_total{decision="decode_only",reason="faster_alone"}'
        )
        == 2
    )


async def test_a_lora_request_is_credited_only_with_its_adapters_blocks(model_dir: Path) -> None:
    """vLLM keys every block of an adapter's request by the adapter's name: the base model's
    blocks on D do not make an adapter's long prompt decode-only, the adapter's own do."""
    lora = ("--enable-lora", "--lora-modules", "sim-lora=/adapters/sim-lora")
    async with topology(
        1,
        1,
        engine_flags=(*engine_flags(model_dir), *lora),
        endpoint=kv_endpoint,
        prefill=kv_pool(),
        decode=kv_pool(),
        tokenizer=str(model_dir),
        decision={"mode": "threshold", "max_prompt_tokens": 64},
    ) as topo:
        [holder] = topo.decodes
        prompt = words(300, 200)

        def body(marker: str, model: str) -> bytes:
            doc = orjson.loads(completion_body(f"{prompt} {marker} w4", max_tokens=4))
            return orjson.dumps(doc | {"model": model})

        await direct(topo, holder, "/v1/completions", body("w1", MODEL))  # base blocks on D
        await held_by_index(topo, holder)
        status, text, _ = await topo.post("/v1/completions", body("mk-lora", "sim-lora"))
        assert status == 200, text
        assert len(await served(topo, topo.prefills, "mk-lora")) == 1  # not credited: P/D
        await direct(topo, holder, "/v1/completions", body("w2", "sim-lora"))
        await held_by_index(topo, holder, at_least=2)
        for marker, model in (("mk-lora2", "sim-lora"), ("mk-base", MODEL)):
            status, text, _ = await topo.post("/v1/completions", body(marker, model))
            assert status == 200, text
            assert await served(topo, topo.prefills, marker) == []  # decode-only
            assert await served(topo, topo.decodes, marker) == [address(holder)]


async def test_a_new_prompt_on_idle_engines_still_disaggregates(topo_2p2d: Topology) -> None:
    """The decision's other side: nothing cached, P/D costs no more here, so P computes it."""
    topo = topo_2p2d
    status, text, _ = await topo.post("/v1/completions", completion_body(f"{words(9, 80)} mk-c"))
    assert status == 200, text
    assert len(await served(topo, topo.prefills, "mk-c")) == 1


async def test_an_engine_restart_drops_its_entries(model_dir: Path) -> None:
    """A decode engine, whose pool reads no load (round_robin) and with the KV check off: only
    the KV events' own scrape sees its new start time, before it publishes anything again
    (nothing is sent after the restart)."""
    async with topology(
        1,
        1,
        engine_flags=engine_flags(model_dir),
        endpoint=kv_endpoint,
        prefill=kv_pool(),
        decode=kv_pool("round_robin"),
        tokenizer=str(model_dir),
        kv_check={"enabled": False},
        health={"interval_s": 0.2},
    ) as topo:
        decode = topo.decodes[0]
        await direct(topo, decode, "/v1/completions", completion_body(words(3, 60)))
        await held_by_index(topo, decode)
        blocks = "pd_extproc_kv_index_blocks"
        before = await metric(topo, blocks)
        assert before >= 15  # its 15 full blocks (61 tokens)
        await topo.sim(decode, "POST", "/sim/restart", {})
        restart = (
            f'pd_extproc_kv_index_resets_total{{endpoint="{address(decode)}",reason="restart"}}'
        )

        async def dropped() -> bool:
            return await metric(topo, restart) >= 1 and await metric(topo, blocks) == 0

        await until(dropped, "the restarted engine's entries to be dropped")


async def test_engines_without_events_fall_back_quietly(model_dir: Path) -> None:
    """Their pool reads KV events, but they publish none (no --kv-events-config): requests
    still keep to an engine per prompt, by the hash of the prompt's start, with no warning."""
    quiet_flags = (*FAST, "--tokenizer", str(model_dir), "--block-size", str(BLOCK))
    with socket.socket() as nobody:  # a port that refuses: where no engine publishes
        nobody.bind(("127.0.0.1", 0))
        silent = {
            "policy": "kv_cache",
            "kv_events": {"port": nobody.getsockname()[1], "replay_port": None},
        }
        async with topology(
            2, 1, engine_flags=quiet_flags, prefill=silent, decode=silent, tokenizer=str(model_dir)
        ) as topo:
            await fall_back(topo)


async def fall_back(topo: Topology) -> None:
    """Two prompts per engine, in the order round robin would split."""
    bodies = {g: completion_body(f"{words(g * 7, 40)} grp-{g}") for g in range(40)}
    places = {g: fallback_choice(topo.prefills, Api.COMPLETIONS, b) for g, b in bodies.items()}
    groups = [g for g in places if places[g] == address(topo.prefills[0])][:2]
    groups += [g for g in places if places[g] == address(topo.prefills[1])][:2]
    for g in groups:
        status, text, _ = await topo.post("/v1/completions", bodies[g])
        assert status == 200, text
    for g in groups:
        # the marker ends the prompt: with its closing quote, grp-1 is not found in grp-12
        assert await served(topo, topo.prefills, f'grp-{g}"') == [places[g]]
    assert "WARNING" not in topo.sidecar.log_text()  # quietly


async def test_an_engine_removed_from_the_pool_leaves_the_index(
    model_dir: Path, tmp_path: Path
) -> None:
    """The engine that leaves publishes on ipc:// sockets (an endpoint's own addresses)."""
    ipc = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{tmp_path}/p.pub",
            "replay_endpoint": f"ipc://{tmp_path}/p.replay",
        }
    )
    flags = (*engine_flags(model_dir)[:-1], ipc)
    async with (
        running_engine("--kv-transfer-config", PUSH[0], *flags) as gone,
        topology(
            1,
            1,
            engine_flags=engine_flags(model_dir),
            endpoint=kv_endpoint,
            extra_prefills=[gone],
            prefill=kv_pool(),
            decode=kv_pool(),
            tokenizer=str(model_dir),
        ) as topo,
    ):
        assert (gone.kv_events_endpoint or "").startswith("ipc://")
        await direct(topo, gone, "/v1/completions", completion_body(words(0, 40)))
        await held_by_index(topo, gone)
        assert await metric(topo, "pd_extproc_kv_index_blocks") == 10  # 41 tokens
        series = (
            f'pd_extproc_kv_event_batches_total{{endpoint="{address(gone)}",outcome="applied"}}'
        )
        config = yaml.safe_load(topo.sidecar.config_path.read_text())
        config["prefill"]["endpoints"] = config["prefill"]["endpoints"][:1]
        topo.sidecar.config_path.write_text(yaml.safe_dump(config))
        os.kill(topo.sidecar.pid, signal.SIGHUP)

        async def left() -> bool:
            samples = await topo.metrics()
            return series not in samples and samples.get("pd_extproc_kv_index_blocks", 1) == 0

        await until(left, "the removed engine's entries and series to go")
