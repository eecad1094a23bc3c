"""With a tokenizer configured, no request stalls the sidecar: real Envoy, the real ext_proc,
vllmsim engines. The stall is the longest time the ext_proc's `/live` (served on its event loop)
takes to answer while a big request is in; a request tokenized on the loop stalled it for
seconds. A long prompt's stall is bounded by 0.25 s outright (10 and 16 MB: 0.06-0.12 s with a
tokenizer on this 2-core machine at a load average of 5-7). A chat's is bounded over the same
request's stall in a sidecar without a tokenizer, by 0.25 s: 10^5 messages cost the loop
0.15-0.21 s without one there at a load average of 3-4 (decoding them, then finding the
body's members, two steps with the loop running between).

The sidecar's tokenizer is word-level with every space a token of its own, and one
2,000-character token in its vocabulary: the engines' context length (vllmsim's 8,192 tokens,
learned by the probe) then bounds what is worth tokenizing at 16 M characters, so every prompt
here is tokenized, at one token a byte: seconds of work, in the workers. The prompts are mostly
spaces, which the engines (no tokenizer: vllmsim counts words) skip at once, so that what is
measured is the sidecar, not two engines busy counting millions of words.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
import pytest
import pytest_asyncio
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from tests.support.engines import MODEL
from tests.support.topology import Topology, topology
from vllmsim.launcher import FAST

STALL_S = 0.25
# eight 10 MB prompts encoded in two workers, up to 1 s each, on the machine's two cores
TOKENIZING_S = 2.0
MB = 1_000_000
WORDS = [f"w{i}" for i in range(400)]
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools> {{ tools | tojson }} {% endif %}"
    "{% for m in messages %} <{{ m['role'] }}> {{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} <assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("stall-model")
    special = ["<s>", "</s>", "<unk>", "<user>", "<assistant>", "<tools>", " ", "x" * 2000]
    vocab = {w: i for i, w in enumerate([*special, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest_asyncio.fixture(scope="module")
async def topo(model_dir: Path) -> AsyncIterator[Topology]:
    async with topology(
        engine_flags=FAST,
        prefill={"kv_events": {}},
        decode={"kv_events": {}},
        tokenizer=str(model_dir),
        # eight 10 MB bodies held at once: within the budget (past it they would be shed)
        limits={"max_body_bytes": 16 * 1024 * 1024, "max_body_bytes_in_flight": 256 << 20},
    ) as topo:
        await probed(topo)
        yield topo


@pytest_asyncio.fixture(scope="module")
async def plain() -> AsyncIterator[Topology]:
    """The same sidecar without a tokenizer: what the bodies cost without one."""
    limits = {"max_body_bytes": 16 * 1024 * 1024, "max_body_bytes_in_flight": 256 << 20}
    async with topology(engine_flags=FAST, limits=limits) as topo:
        yield topo


async def probed(topo: Topology) -> None:
    """The start-up probe (which learns the engines' context length) has run: bounded poll."""
    prefill = f"127.0.0.1:{topo.prefills[0].port}"
    for _ in range(200):
        if (await topo.ready())["identities"].get(prefill, {}).get("engine_id"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the probe never learned {prefill}'s identity")


def words(size: int) -> str:
    count = size // 5
    return " ".join(WORDS[i % len(WORDS)] for i in range(count))


def spaced(size: int) -> str:
    """`size` characters: two words apart, spaces between (a token each for the sidecar)."""
    return "w1" + " " * (size - 4) + "w2"


def completion(size: int) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": spaced(size), "max_tokens": 1})


def chat_of_messages(count: int) -> bytes:
    messages = [{"role": "user", "content": f"{WORDS[i % 400]} w1 w2"} for i in range(count)]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 1})


def chat_with_tools(size: int) -> bytes:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "description": spaced(200),
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
    tools = [tool] * (size // len(orjson.dumps(tool)))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "tools": tools}
    return orjson.dumps(body | {"max_tokens": 1})


async def post(topo: Topology, session: aiohttp.ClientSession, path: str, body: bytes) -> float:
    """Seconds to the whole answer (any status: the engines refuse what exceeds their
    context; what is measured is the sidecar)."""
    started = time.perf_counter()
    async with session.post(
        topo.sidecar.url + path,
        data=body,
        headers={"content-type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=120),
    ) as response:
        await response.read()
        assert response.status < 500, response.status
    return time.perf_counter() - started


async def longest_live_answer(topo: Topology, during: Awaitable[object]) -> float:
    """The longest `/live` answer time while `during` runs (asked every 20 ms)."""
    work = asyncio.ensure_future(during)
    longest = 0.0
    async with aiohttp.ClientSession() as session:  # its own connection: nothing queues it
        while not work.done():
            started = time.perf_counter()
            async with session.get(
                topo.sidecar.metrics + "/live", timeout=aiohttp.ClientTimeout(total=60)
            ) as response:
                assert response.status == 200
            longest = max(longest, time.perf_counter() - started)
            await asyncio.wait([work], timeout=0.02)
    await work
    return longest


@pytest.mark.parametrize(
    ("path", "make", "size"),
    [
        ("/v1/completions", completion, 10 * MB),
        ("/v1/completions", completion, 16 * MB),
        ("/v1/chat/completions", chat_of_messages, 100_000),
        ("/v1/chat/completions", chat_with_tools, 5 * MB),
    ],
    ids=["10MB-prompt", "16MB-prompt", "1e5-messages", "5MB-tools"],
)
async def test_a_big_request_does_not_stall_the_loop(
    topo: Topology, plain: Topology, path: str, make: Callable[[int], bytes], size: int
) -> None:
    raw = make(size)
    if make is completion:  # the body's own cost is well under the bound
        stall = await longest_live_answer(topo, post(topo, topo.session, path, raw))
        assert stall < STALL_S, stall
        return
    without = await longest_live_answer(plain, post(plain, plain.session, path, raw))
    stall = await longest_live_answer(topo, post(topo, topo.session, path, raw))
    assert stall < without + STALL_S, (stall, without)


async def small_p99_beside_eight(topo: Topology) -> float:
    """Another client's small requests' p99 latency while eight 10 MB prompts are in."""
    big = completion(10 * MB)
    small = orjson.dumps({"model": MODEL, "prompt": words(2000), "max_tokens": 1})
    latencies: list[float] = []

    async def small_client(session: aiohttp.ClientSession, done: asyncio.Event) -> None:
        while not done.is_set():
            latencies.append(await post(topo, session, "/v1/completions", small))

    done = asyncio.Event()
    async with aiohttp.ClientSession() as small_session:
        clients = [asyncio.create_task(small_client(small_session, done)) for _ in range(4)]
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(post(topo, session, "/v1/completions", big) for _ in range(8)))
        done.set()
        await asyncio.gather(*clients)
    assert len(latencies) >= 10, latencies
    latencies.sort()
    return latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]


async def test_eight_10MB_prompts_leave_small_requests_fast(
    topo: Topology, plain: Topology
) -> None:
    """The bound is over the same load without a tokenizer: eight 10 MB bodies cost Envoy,
    the engines and the ext_proc's loop (gRPC, decoding, copying into both legs) 0.8-2.1 s of
    the small requests' p99 on a busy 2-core machine (bench/results/big-bodies.md), twice that
    for its own noise. Here every prompt is also encoded, in one of the tokenizer's two worker
    processes (the other is left to short prompts such as the small requests'), for up to 1 s
    each: CPU the rest of the machine does not get, which TOKENIZING_S allows for (measured
    0.6-1.2 s with a tokenizer, 0.8-1.6 s without; 1.4-2.6 s when the small requests queued
    for a worker behind the big ones). Tokenizing on the loop had them wait for minutes."""
    without = await small_p99_beside_eight(plain)
    p99 = await small_p99_beside_eight(topo)
    assert p99 < 2 * without + TOKENIZING_S, (p99, without)


DEEP = b'{"a":[' * 500 + b'"x"' + b"]}" * 500
USER = b'{"model":"m","messages":[{"role":"user","content":"w1"}],'


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        (
            "/v1/chat/completions",
            b'{"model":"m","messages":[{"role":"user","content":' + DEEP + b"}]}",
            "nested more than 64 levels deep",
        ),
        ("/v1/chat/completions", USER + b'"tools":' + DEEP + b"}", "nested more than 64"),
        ("/v1/chat/completions", USER + b'"chat_template_kwargs":' + DEEP + b"}", "nested more"),
        ("/v1/completions", b'{"model":"m","prompt":[1,408]}', "outside the model's vocabulary"),
    ],
    ids=["deep-content", "deep-tools", "deep-template-kwargs", "id-past-the-vocabulary"],
)
async def test_with_a_tokenizer_bad_input_gets_a_400_and_reaches_no_engine(
    topo: Topology, path: str, body: bytes, fragment: str
) -> None:
    await topo.clear()
    status, payload, _ = await topo.post(path, body)
    assert status == 400, payload
    error = orjson.loads(payload)["error"]
    assert error["code"] == 400 and fragment in error["message"], error
    for engine in topo.engines:
        assert await topo.seen(engine) == []
    assert "Traceback" not in topo.sidecar.log_text()
