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
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from extproc.policies import PrefixPicker
from extproc.request.parse import Api, parse_request
from extproc.request.plan import pick_request
from extproc.scheduling.pool import EndpointState
from tests.integration.conftest import MODEL, Topology, address, topology, until
from vllmsim.launcher import FAST, EngineHandle

BLOCK = 4
WORDS = [f"w{i}" for i in range(400)]
TEMPLATE = ("{{ bos_token }}{% for m in messages %} <{{ m['role'] }}> {{ m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %} <assistant>{% endif %}")  # fmt: skip
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})  # fmt: skip


@pytest.fixture(autouse=True)
def loopback_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines bind their KV event sockets (tcp://*:0) on 127.0.0.1, as vLLM does on
    VLLM_HOST_IP."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder both the engines and the sidecar tokenize with."""
    folder = tmp_path_factory.mktemp("kv-model")
    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>", "<system>", "<user>",
                                         "<assistant>", *WORDS])}  # fmt: skip
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                             special_tokens=[("<s>", 0)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))  # fmt: skip
    return folder


def words(start: int, n: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def kv_endpoint(engine: EngineHandle) -> dict[str, Any]:
    """A static endpoint with its own KV event ports (every engine here shares 127.0.0.1)."""
    def port(endpoint: str | None) -> int | None:
        return None if endpoint is None else int(endpoint.rsplit(":", 1)[1])

    return {"address": address(engine),
            "kv_events": {"port": port(engine.kv_events_endpoint),
                          "replay_port": port(engine.kv_events_replay_endpoint)}}  # fmt: skip


def engine_flags(model_dir: Path) -> tuple[str, ...]:
    return (*FAST, "--tokenizer", str(model_dir), "--block-size", str(BLOCK),
            "--enable-prefix-caching", "--kv-events-config", EVENTS)


def kv_pool(policy: str = "kv_cache") -> dict[str, Any]:
    return {"policy": policy, "kv_events": {}}


@pytest.fixture
async def topo_2p2d(model_dir: Path) -> AsyncIterator[Topology]:
    async with topology(2, 2, engine_flags=engine_flags(model_dir), endpoint=kv_endpoint,
                        prefill=kv_pool(), decode=kv_pool(), tokenizer=str(model_dir),
                        decision={"mode": "load_aware", "pd_overhead_ms": 0}) as topo:
        yield topo


def fallback_choice(engines: list[EngineHandle], api: Api, body: bytes) -> str:
    """Where the approximate fallback (prompt-start hashing) sends `body` among idle engines."""
    wanted = pick_request(parse_request(api, body, 1 << 20), None)
    return PrefixPicker().pick([EndpointState(address(e)) for e in engines], wanted).address


def completion_body(prompt: str, max_tokens: int = 2) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0})  # fmt: skip


async def direct(topo: Topology, engine: EngineHandle, path: str, body: bytes) -> dict[str, Any]:
    """A request sent to the engine itself (as another router would): it fills its cache."""
    async with topo.session.post(engine.url + path, data=body,
                                 headers={"content-type": "application/json"}) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


async def metric(topo: Topology, name: str) -> float:
    return (await topo.metrics()).get(name, 0.0)


async def served(topo: Topology, engines: list[EngineHandle], marker: str) -> list[str]:
    """Addresses of the engines whose request log has a request containing `marker`."""
    return [address(e) for e in engines
            if any(marker in json.dumps(r["body"]) for r in await topo.seen(e))]  # fmt: skip


async def held_by_index(topo: Topology, engine: EngineHandle, at_least: int = 1) -> None:
    """Wait until the sidecar has applied `at_least` of the engine's event batches."""
    name = (f'pd_extproc_kv_event_batches_total{{endpoint="{address(engine)}",'
            'outcome="applied"}')
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


async def test_the_next_turn_goes_decode_only_to_the_decode_that_holds_it(
    topo_2p2d: Topology,
) -> None:
    topo = topo_2p2d
    system = {"role": "system", "content": words(50, 200)}
    turn1 = [system, {"role": "user", "content": "w1 w2 w3"}]
    first = orjson.dumps({"model": MODEL, "messages": turn1, "max_tokens": 8, "temperature": 0})
    turn2 = [*turn1, {"role": "assistant", "content": "w8 w9"},
             {"role": "user", "content": "marker-b w4"}]  # fmt: skip
    second = orjson.dumps({"model": MODEL, "messages": turn2, "max_tokens": 4, "temperature": 0})
    # The conversation started on the decode the fallback would not pick for its next turn.
    holder = next(d for d in topo.decodes
                  if address(d) != fallback_choice(topo.decodes, Api.CHAT, second))  # fmt: skip
    await direct(topo, holder, "/v1/chat/completions", first)  # its first turn, served there
    await held_by_index(topo, holder)

    status, text, _ = await topo.post("/v1/chat/completions", second)
    assert status == 200, text
    assert await served(topo, topo.decodes, "marker-b") == [address(holder)]
    assert await served(topo, topo.prefills, "marker-b") == []  # D prefilled the rest alone
    decode_only = ('pd_extproc_dispatch_decisions_total{decision="decode_only",'
                   'reason="faster_alone"}')
    assert await metric(topo, decode_only) == 1


async def test_a_new_prompt_on_idle_engines_still_disaggregates(topo_2p2d: Topology) -> None:
    """The decision's other side: nothing cached, P/D costs no more here, so P computes it."""
    topo = topo_2p2d
    status, text, _ = await topo.post("/v1/completions", completion_body(f"{words(9, 80)} mk-c"))
    assert status == 200, text
    assert len(await served(topo, topo.prefills, "mk-c")) == 1


async def test_an_engine_restart_drops_its_entries(model_dir: Path) -> None:
    """Seen by the restart detector (the engine's start time), before the engine publishes
    anything again: nothing is sent after the restart."""
    async with topology(1, 1, engine_flags=engine_flags(model_dir), endpoint=kv_endpoint,
                        prefill=kv_pool(), decode=kv_pool(), tokenizer=str(model_dir),
                        health={"interval_s": 0.2}) as topo:
        prefill = topo.prefills[0]
        status, text, _ = await topo.post("/v1/completions", completion_body(words(3, 60)))
        assert status == 200, text
        await held_by_index(topo, prefill)
        blocks = 'pd_extproc_kv_index_blocks'

        async def index_holds() -> bool:
            return await metric(topo, blocks) > 0
        await until(index_holds, "the index to hold the prompt's blocks")
        before = await metric(topo, blocks)
        assert await topo.sim(prefill, "POST", "/sim/restart", {}) is not None
        restart = (f'pd_extproc_kv_index_resets_total{{endpoint="{address(prefill)}",'
                   'reason="restart"}')

        async def dropped() -> bool:
            return await metric(topo, restart) >= 1 and await metric(topo, blocks) < before
        await until(dropped, "the restarted engine's entries to be dropped")
        assert "Traceback" not in topo.sidecar.log_text()


async def test_engines_without_events_fall_back_quietly(model_dir: Path) -> None:
    """Their pool reads KV events, but they publish none (no --kv-events-config): requests
    still keep to an engine per prompt, by the hash of the prompt's start, with no warning."""
    quiet_flags = (*FAST, "--tokenizer", str(model_dir), "--block-size", str(BLOCK))
    with socket.socket() as nobody:  # a port that refuses: where no engine publishes
        nobody.bind(("127.0.0.1", 0))
        silent = {"policy": "kv_cache", "kv_events": {"port": nobody.getsockname()[1],
                                                      "replay_port": None}}  # fmt: skip
        async with topology(2, 1, engine_flags=quiet_flags, prefill=silent, decode=silent,
                            tokenizer=str(model_dir)) as topo:
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
        assert await served(topo, topo.prefills, f"grp-{g}") == [places[g]]
    assert "WARNING" not in topo.sidecar.log_text()  # quietly


async def test_an_engine_removed_from_the_pool_leaves_the_index(model_dir: Path) -> None:
    async with topology(2, 1, engine_flags=engine_flags(model_dir), endpoint=kv_endpoint,
                        prefill=kv_pool(), decode=kv_pool(), tokenizer=str(model_dir)) as topo:
        gone = topo.prefills[1]
        await direct(topo, gone, "/v1/completions", completion_body(words(0, 40)))
        await held_by_index(topo, gone)
        series = (f'pd_extproc_kv_event_batches_total{{endpoint="{address(gone)}",'
                  'outcome="applied"}')
        config = yaml.safe_load(topo.sidecar.config_path.read_text())
        config["prefill"]["endpoints"] = config["prefill"]["endpoints"][:1]
        topo.sidecar.config_path.write_text(yaml.safe_dump(config))
        os.kill(topo.sidecar.pid, signal.SIGHUP)

        async def left() -> bool:
            samples = await topo.metrics()
            return series not in samples and samples.get("pd_extproc_kv_index_blocks", 1) == 0
        await until(left, "the removed engine's entries and series to go")
