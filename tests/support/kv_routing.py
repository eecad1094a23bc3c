"""What the KV-routing tests share (the sidecar's and the endpoint picker's): a word-level
tokenizer made on the spot (one token a word, a BOS first) that the engines and the sidecar both
tokenize with, engines with a prefix cache publishing vLLM's KV events, and their endpoints."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from extproc.policies import PrefixPicker
from extproc.request.parse import Api, parse_request
from extproc.request.plan import pick_request
from extproc.scheduling.pool import EndpointState
from tests.support.engines import free_port
from tests.support.topology import MODEL, address
from vllmsim.launcher import FAST, EngineHandle

BLOCK = 4
WORDS = [f"w{i}" for i in range(400)]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %} <{{ m['role'] }}> {{ m['content'] }}"
    "{% endfor %}{% if add_generation_prompt %} <assistant>{% endif %}"
)
EVENTS = json.dumps(
    {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
    }
)


@pytest.fixture(autouse=True)
def loopback_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines bind their KV event sockets (tcp://*:0) on 127.0.0.1, as vLLM does on
    VLLM_HOST_IP."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder both the engines and the sidecar tokenize with."""
    folder = tmp_path_factory.mktemp("kv-model")
    vocab = {
        w: i
        for i, w in enumerate(["<s>", "</s>", "<unk>", "<system>", "<user>", "<assistant>", *WORDS])
    }
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    )
    return folder


def words(start: int, n: int) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def kv_endpoint(engine: EngineHandle) -> dict[str, Any]:
    """A static endpoint with its own KV event sockets (every engine here shares 127.0.0.1):
    its ports, or its ipc:// addresses."""
    if (engine.kv_events_endpoint or "").startswith("ipc://"):
        return {
            "address": address(engine),
            "kv_events": {
                "endpoint": engine.kv_events_endpoint,
                "replay_endpoint": engine.kv_events_replay_endpoint,
            },
        }

    def port(endpoint: str | None) -> int | None:
        return None if endpoint is None else int(endpoint.rsplit(":", 1)[1])

    return {
        "address": address(engine),
        "kv_events": {
            "port": port(engine.kv_events_endpoint),
            "replay_port": port(engine.kv_events_replay_endpoint),
        },
    }


def engine_flags(model_dir: Path) -> tuple[str, ...]:
    return (
        *FAST,
        "--tokenizer",
        str(model_dir),
        "--block-size",
        str(BLOCK),
        "--enable-prefix-caching",
        "--kv-events-config",
        EVENTS,
    )


def connecting_engine_flags(model_dir: Path, listener_port: int) -> Callable[[], tuple[str, ...]]:
    """Flags for engines set up as llm-d sets them up: each one's KV event publisher connects
    to the sidecar's listener (`tcp://127.0.0.1:<listener_port>`) with the topic
    `kv@<its address>@<model>`. Every engine here shares 127.0.0.1, so the topic names its
    `ip:port` (llm-d's pods have an IP each: `kv@<pod IP>@<model>`); its HTTP port is picked
    before it starts, for the topic."""

    def flags() -> tuple[str, ...]:
        port = free_port()
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{listener_port}",
            "topic": f"kv@127.0.0.1:{port}@{MODEL}",
        }
        return (
            *engine_flags(model_dir)[:-1],  # all but the events' JSON, given here instead
            json.dumps(events),
            "--port",
            str(port),
        )

    return flags


def kv_pool(policy: str = "kv_cache") -> dict[str, Any]:
    return {"policy": policy, "kv_events": {}}


def fallback_choice(engines: list[EngineHandle], api: Api, body: bytes) -> str:
    """Where the approximate fallback (prompt-start hashing) sends `body` among idle engines."""
    wanted = pick_request(parse_request(api, body, 1 << 20), None)
    return PrefixPicker().pick([EndpointState(address(e)) for e in engines], wanted).address


def completion_body(prompt: str, max_tokens: int = 2) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    )
