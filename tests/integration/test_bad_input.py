"""Bad input through the real Envoy and ext_proc: a clear OpenAI-style error, nothing
forwarded to an engine, and no 5xx or hang for thousands of random bodies."""

from __future__ import annotations

import asyncio
import gzip
import random
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
import pytest_asyncio

from extproc.protocol.bodies import buffer_bytes
from tests.support.engines import MODEL
from tests.support.topology import Topology, topology
from vllmsim.launcher import FAST

LIMIT = 64 * 1024
# a short max-model-len keeps requests without max_tokens (the engine's default: the rest
# of the context) from generating for seconds
FLAGS = (*FAST, "--max-model-len", "512")


@pytest_asyncio.fixture(scope="module")
async def topo() -> AsyncIterator[Topology]:
    async with topology(engine_flags=FLAGS, limits={"max_body_bytes": LIMIT}) as topo:
        yield topo


async def send(topo: Topology, method: str, path: str, data: bytes) -> tuple[int, bytes, str]:
    async with topo.session.request(
        method,
        topo.sidecar.url + path,
        data=data,
        headers={"content-type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=10),
    ) as response:
        return response.status, await response.read(), response.headers.get("content-type", "")


CASES = [
    ("invalid JSON", "POST", "/v1/completions", b'{"model": "m", "prompt": ', 400, "JSON"),
    ("non-object", "POST", "/v1/completions", b'["a", "b"]', 400, "JSON object"),
    (
        "wrong type",
        "POST",
        "/v1/completions",
        b'{"model":"m","prompt":"p","max_tokens":"8"}',
        400,
        "max_tokens",
    ),
    ("missing model", "POST", "/v1/completions", b'{"prompt":"p"}', 400, "model"),
    ("n > 1", "POST", "/v1/completions", b'{"model":"m","prompt":"p","n":3}', 400, "'n'"),
    ("n = 0", "POST", "/v1/completions", b'{"model":"m","prompt":"p","n":0}', 400, "'n' is 0"),
    (
        "list of prompts",
        "POST",
        "/v1/completions",
        b'{"model":"m","prompt":["a","b"]}',
        400,
        "list of 2 prompts",
    ),
    (
        "empty prompt list",
        "POST",
        "/v1/completions",
        b'{"model":"m","prompt":[]}',
        400,
        "empty list",
    ),
    ("non-UTF-8", "POST", "/v1/completions", b'{"model":"m","prompt":"\xc3\x28"}', 400, "UTF-8"),
    (
        "gzip body",
        "POST",
        "/v1/completions",
        gzip.compress(b'{"model":"m","prompt":"p"}'),
        400,
        "gzip-compressed",
    ),
    (
        "max_tokens beyond 64 bits",
        "POST",
        "/v1/completions",
        b'{"model":"m","prompt":"p","max_tokens":%d}' % 2**70,
        400,
        "too large",
    ),
    (
        "stream_options without stream",
        "POST",
        "/v1/chat/completions",
        b'{"model":"m","messages":[{"role":"user","content":"x"}],'
        b'"stream_options":{"include_usage":true}}',
        400,
        "stream_options",
    ),
    (
        "unsupported path",
        "POST",
        "/v1/embeddings",
        b'{"model":"m","input":"x"}',
        404,
        "not served here",
    ),
    ("unsupported method", "GET", "/v1/completions", b"", 405, "GET"),
    ("empty body", "POST", "/v1/completions", b"", 400, "no body"),
    (
        "JSON nested 1,000 deep",
        "POST",
        "/v1/chat/completions",
        b'{"model":"m","messages":[{"role":"user","content":'
        + b'{"a":[' * 500
        + b'"x"'
        + b"]}" * 500
        + b"}]}",
        400,
        "nested more than 64 levels deep",
    ),
    ("negative token id", "POST", "/v1/completions", b'{"model":"m","prompt":[1,-1]}', 400, "-1"),
    (
        "token id 2**40",
        "POST",
        "/v1/completions",
        b'{"model":"m","prompt":[1,%d]}' % 2**40,
        400,
        f"token id {2**40}",
    ),
    (
        "token id 2**63",
        "POST",
        "/v1/completions",
        b'{"model":"m","prompt":[1,%d]}' % 2**63,
        400,
        f"token id {2**63}",
    ),
    (
        "over the limit",
        "POST",
        "/v1/completions",
        b'{"model":"m","prompt":"' + b"x" * LIMIT + b'"}',
        413,
        f"{LIMIT} bytes",
    ),
    (
        "over Envoy's buffer",
        "POST",
        "/v1/completions",
        b'{"model":"m","prompt":"' + b"x" * buffer_bytes(LIMIT) + b'"}',
        413,
        f"{LIMIT} bytes",
    ),
]


@pytest.mark.parametrize(
    ("method", "path", "data", "status", "fragment"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
async def test_bad_input_gets_a_clear_error_and_reaches_no_engine(
    topo: Topology, method: str, path: str, data: bytes, status: int, fragment: str
) -> None:
    await topo.clear()
    got, body, content_type = await send(topo, method, path, data)
    assert got == status, body
    assert content_type == "application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == status and fragment in error["message"]
    for engine in topo.engines:
        assert await topo.seen(engine) == []


def body_of_size(size: int, path: str) -> bytes:
    """A short request padded (in `user`, which engines ignore) to exactly `size` bytes."""
    doc: dict[str, object] = {"model": MODEL, "max_tokens": 2, "user": ""}
    if path == "/v1/completions":
        doc["prompt"] = "Tell me a story"
    else:
        doc["messages"] = [{"role": "user", "content": "Tell me a story"}]
    doc["user"] = "u" * (size - len(orjson.dumps(doc)))
    raw = orjson.dumps(doc)
    assert len(raw) == size
    return raw


async def assert_served_at_the_limit(topo: Topology, path: str, serial: bool) -> None:
    """A body of exactly the limit is served, though both legs' bodies are longer."""
    await topo.clear()
    status, body, _ = await send(topo, "POST", path, body_of_size(LIMIT, path))
    assert status == 200, body
    [p_record] = await topo.seen(topo.prefills[0])
    [d_record] = await topo.seen(topo.decodes[0])
    # a serial D body carries P's own params, with its list of KV blocks
    assert ("remote_block_ids" in d_record["body"]["kv_transfer_params"]) is serial
    assert p_record["body_bytes"] > LIMIT and d_record["body_bytes"] > LIMIT


async def wait_for_identity(topo: Topology) -> None:
    """The start-up probe runs once the sidecar is ready: poll (bounded) for its result."""
    prefill = f"127.0.0.1:{topo.prefills[0].port}"
    for _ in range(100):
        if (await topo.ready())["identities"].get(prefill, {}).get("engine_id"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the probe never learned {prefill}'s identity")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_body_of_exactly_the_limit_is_served_in_parallel(topo: Topology, path: str) -> None:
    await wait_for_identity(topo)
    await assert_served_at_the_limit(topo, path, serial=False)


async def test_body_of_exactly_the_limit_is_served_in_serial() -> None:
    config = {"limits": {"max_body_bytes": LIMIT}, "dispatch": {"mode": "serial_push"}}
    async with topology(engine_flags=FLAGS, **config) as serial:
        await assert_served_at_the_limit(serial, "/v1/completions", serial=True)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_body_one_byte_over_the_limit_gets_413_before_any_leg(
    topo: Topology, path: str
) -> None:
    await topo.clear()
    status, body, content_type = await send(topo, "POST", path, body_of_size(LIMIT + 1, path))
    assert status == 413, body
    assert content_type == "application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == 413 and f"{LIMIT} bytes" in error["message"]
    for engine in topo.engines:
        assert await topo.seen(engine) == []


async def raw_request(topo: Topology, target: bytes, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request written by hand: HTTP clients strip a '#fragment' themselves."""
    host, port = topo.sidecar.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST " + target + b" HTTP/1.1\r\nhost: pd\r\nconnection: close\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        )
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


@pytest.mark.parametrize("target", [b"/v1/completions#frag", b"/v1/completions?x=1#frag"])
async def test_fragment_target_gets_a_message(topo: Topology, target: bytes) -> None:
    await topo.clear()
    body = orjson.dumps({"model": MODEL, "prompt": "p", "max_tokens": 1})
    status, payload = await raw_request(topo, target, body)
    assert status == 400, payload
    error = orjson.loads(payload)["error"]
    assert error["code"] == 400 and "'#fragment'" in error["message"], error
    for engine in topo.engines:
        assert await topo.seen(engine) == []


def random_value(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "str", "bool", "null", "float"] + (["list", "dict"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([-1, 0, 1, 2, 7, 2**40])
    if kind == "str":
        return "".join(rng.choice('ab "\\{}[],:é\u2028\x00') for _ in range(rng.randint(0, 12)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "float":
        return rng.uniform(-2, 2)
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "kv_transfer_params",
    "request_id",
]


def random_body(rng: random.Random) -> bytes:
    """Mostly plausible requests with a few fields perturbed, some garbage bytes."""
    roll = rng.random()
    if roll < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    doc: dict[str, object] = {
        "model": MODEL,
        "prompt": "fuzz " * rng.randint(1, 20),
        "max_tokens": rng.randint(1, 4),
    }
    if rng.random() < 0.3:
        doc = {"model": MODEL, "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2}
    for _ in range(rng.randint(0, 3)):
        doc[rng.choice(FIELDS)] = random_value(rng)
    raw = orjson.dumps(doc)
    if roll < 0.1:  # truncated or with a stray byte
        cut = rng.randrange(len(raw))
        raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1 :]
    return raw


async def test_fuzz_bodies_never_get_a_5xx_or_hang(topo: Topology) -> None:
    rng = random.Random(20261129)
    bodies = [random_body(rng) for _ in range(2000)]
    paths = ["/v1/completions", "/v1/chat/completions"]
    semaphore = asyncio.Semaphore(16)
    statuses: dict[int, int] = {}
    server_errors: list[tuple[int, bytes, bytes]] = []

    async def one(i: int, body: bytes) -> None:
        async with semaphore:
            status, payload, _ = await send(topo, "POST", paths[i % 2], body)
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500:
            server_errors.append((status, body, payload))

    await asyncio.wait_for(
        asyncio.gather(*(one(i, body) for i, body in enumerate(bodies))), timeout=240
    )
    assert server_errors == [], server_errors[:5]
    assert sum(statuses.values()) == len(bodies)
    assert statuses.get(200, 0) > 200, statuses  # the fuzz also exercises the happy path
    # Envoy closes each ext_proc stream just after the client got its answer: allow a moment
    for _ in range(50):
        ready = await topo.ready()
        inflight = [e["in_flight"] for role in ("prefill", "decode") for e in ready[role].values()]
        if not any(inflight):
            break
        await asyncio.sleep(0.1)
    assert not any(inflight), ready
