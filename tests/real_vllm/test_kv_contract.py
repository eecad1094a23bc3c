"""The KV index's contract with vLLM itself (the cached vllm venv; no engine is started):
its event batches, as vLLM's encoder and ZmqEventPublisher send them, decode and apply to the
same blocks, gap replay included; and a request's token ids, completion and chat, equal what
vLLM's own renderer gives for the tiny model."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
from pathlib import Path

import pytest

from extproc.kvcache.events import AllCleared, BlocksRemoved, BlocksStored, decode_batch
from extproc.kvcache.index import KvIndex
from extproc.kvcache.subscriber import EngineEvents
from extproc.kvcache.tokens import RequestTokenizer
from extproc.metrics import Metrics
from scripts.cached_envs import tiny_model, vllm_venv

pytestmark = pytest.mark.real_vllm

SIDE = str(Path(__file__).with_name("kv_vllm_side.py"))
# the low 60 bits of each engine hash (what the index keeps of vLLM's 64)
H1, H2, H3, H4 = (
    int.from_bytes(bytes([b]) * 8, "big") & (2**60 - 1) for b in (0x11, 0x22, 0x33, 0x44)
)


def _vllm(*args: str, stdin: str = "") -> str:
    python = str(vllm_venv() / "bin" / "python")
    done = subprocess.run(
        [python, SIDE, *args], input=stdin, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_batches_encoded_by_vllm_decode_to_the_same_blocks() -> None:
    payloads = [base64.b64decode(p) for p in json.loads(_vllm("encode"))]
    decoded = [decode_batch(p) for p in payloads]
    assert [b.ts for b in decoded] == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]
    assert [b.events for b in decoded] == [
        (BlocksStored((H1, H2), None, tuple(range(1, 9)), 4, True),),
        (BlocksStored((H3,), H2, tuple(range(9, 13)), 4, True),),
        (BlocksStored((H4,), H3, tuple(range(13, 17)), 4, True),),
        (BlocksRemoved((H4,)),),
        (AllCleared(),),
    ]


async def test_vllm_publisher_replays_what_a_late_subscriber_missed() -> None:
    python = str(vllm_venv() / "bin" / "python")
    proc = await asyncio.create_subprocess_exec(
        python,
        SIDE,
        "publish",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdin is not None and proc.stdout is not None
    index, metrics = KvIndex(max_blocks=1000), Metrics()
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 300)
        endpoint, replay = json.loads(line)
        events = EngineEvents("p0", endpoint, index, metrics, replay_endpoint=replay)
        events.start()
        try:
            async with asyncio.timeout(30):  # SUB joins late: new batches until one arrives
                while metrics.kv_event_batches.labels("p0", "applied")._value.get() < 1:
                    proc.stdin.write(b"more\n")
                    await proc.stdin.drain()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(events.applied.wait(), 0.2)
        finally:
            await events.stop()
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)
    # batches 0..3 came from vLLM's replay buffer: the chain of three blocks, the fourth removed
    assert index.longest_prefix(list(range(1, 17))) == {"p0": 3}
    assert metrics.kv_event_replays.labels("p0", "filled")._value.get() == 1
    assert metrics.kv_event_batches.labels("p0", "replayed")._value.get() >= 4


CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a KV cache?"},
    {"role": "assistant", "content": "Saved attention keys and values."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "And prefix"}, {"type": "text", "text": "caching?"}],
    },
]


def test_token_ids_equal_vllms_for_completions_and_chat() -> None:
    cases = [{"prompt": "Hello there, general Kenobi. " * 20}, {"messages": CHAT}]
    theirs = json.loads(_vllm("tokens", str(tiny_model()), stdin=json.dumps(cases)))
    ours = RequestTokenizer.from_path(tiny_model())
    assert ours.completion(cases[0]["prompt"]) == theirs[0]
    assert ours.chat(CHAT) == theirs[1]
