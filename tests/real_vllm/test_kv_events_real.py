"""KV events from real vLLM engines (the push pair, started with prefix caching and
--kv-events-config): the sidecar's own subscriber, decoder and index, fed by a real engine, give
the block chain of the sidecar's own tokenization, for a completion and a chat request; and the
sidecar routes a prompt whose prefix one engine holds to that engine, which then reports the
prefix as cached (vllm:prefix_cache_hits)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio

from extproc.kvcache.events import BlocksStored, KvEvent
from extproc.kvcache.index import KvIndex
from extproc.kvcache.subscriber import EngineEvents
from extproc.kvcache.tokens import RequestTokenizer
from extproc.metrics import Metrics
from extproc.policies import PrefixPicker
from extproc.request.parse import Api, parse_request
from extproc.request.plan import pick_request
from extproc.scheduling.pool import EndpointState
from extproc.testing import scrape
from scripts.cached_envs import tiny_model
from scripts.real_vllm import RealEngine
from tests.real_vllm.clients import MODEL, PATHS
from tests.support.real_vllm import EnginePool, Setup, counter, engine_metrics, sidecar_for
from vllmsim.launcher import FAST, PUSH_P, running_engine

pytestmark = [pytest.mark.real_vllm, pytest.mark.pair("push"), pytest.mark.timeout(600)]

WAIT_S = 30.0
HITS = "vllm:prefix_cache_hits_total"  # prompt tokens served from the prefix cache
QUERIED = "vllm:prefix_cache_queries_total"  # prompt tokens looked up: requests it served
BATCHES = "pd_extproc_kv_event_batches_total"
BLOCK = 128  # vLLM's KV block size on CPU
SENTENCES = [
    "Prefix caching keeps the keys and values of a prompt's full blocks.",
    "A router that knows which engine holds them sends the next turn there.",
    "Each block is hashed with its parent, so a chain names a whole prefix.",
]


def long_text(tag: str, tokenizer: RequestTokenizer, blocks: int) -> str:
    """Text of a little over `blocks` full blocks, distinct per `tag` from its first token."""
    text = f"[{tag}]"
    n = 0
    while len(tokenizer.completion(text)) < blocks * BLOCK + 16:
        text += f" {tag} {n}: {SENTENCES[n % len(SENTENCES)]}"
        n += 1
    return text


class RecordingIndex(KvIndex):
    """The sidecar's index, also keeping every BlockStored it is given (their token ids) and
    how many batches it applied per engine."""

    def __init__(self, max_blocks: int) -> None:
        super().__init__(max_blocks)
        self.stored: dict[str, list[BlocksStored]] = {}
        self.batches: Counter[str] = Counter()

    def apply(self, engine: str, events: Iterable[KvEvent]) -> None:
        events = list(events)
        self.stored.setdefault(engine, []).extend(e for e in events if isinstance(e, BlocksStored))
        self.batches[engine] += 1
        super().apply(engine, events)


def stored_chain(stored: list[BlocksStored], ours: list[int]) -> list[tuple[int, ...]]:
    """The stored blocks that chain from the root along `ours`, as BlockStored gave their
    token ids: followed by vLLM's own hashes and parent hashes, not by our keys."""
    children: dict[int | None, list[tuple[int, tuple[int, ...]]]] = {}
    for event in stored:
        parent, size = event.parent_engine_hash, event.block_size
        for i, engine_hash in enumerate(event.engine_hashes):
            block = event.token_ids[i * size : (i + 1) * size]
            children.setdefault(parent, []).append((engine_hash, block))
            parent = engine_hash
    chain: list[tuple[int, ...]] = []
    at: int | None = None
    while True:
        start = sum(len(b) for b in chain)
        step = [(h, b) for h, b in children.get(at, []) if list(b) == ours[start : start + len(b)]]
        if not step:
            return chain
        at, block = step[0]
        chain.append(block)


async def until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.2)


async def post(
    session: aiohttp.ClientSession, url: str, api: Api, body: dict[str, Any]
) -> dict[str, Any]:
    async with session.post(url + api.value, json=body) as response:
        raw = await response.read()
        assert response.status == 200, raw[-2000:]
    answer: dict[str, Any] = orjson.loads(raw)
    return answer


def completion(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}


def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def tokenizer() -> RequestTokenizer:
    return RequestTokenizer.from_path(tiny_model())


@pytest_asyncio.fixture(scope="module")
async def own_view(
    pool: EnginePool, session: aiohttp.ClientSession, tokenizer: RequestTokenizer
) -> AsyncIterator[RecordingIndex]:
    """Both engines of the push pair, their KV events applied to one index by the sidecar's
    subscriber (the test's own view, beside any sidecar's), once each has heard from its
    engine (a SUB misses what is sent before it has connected; its first batch makes it ask
    the replay socket for all before)."""
    engines = await pool.get("push")
    index = RecordingIndex(max_blocks=100_000)
    subscribers = []
    for engine in engines:
        assert engine.kv_events_ports is not None, "the push pair publishes no KV events"
        pub, replay = engine.kv_events_ports
        subscribers.append(
            EngineEvents(
                engine.address,
                f"tcp://127.0.0.1:{pub}",
                index,
                Metrics(),
                replay_endpoint=f"tcp://127.0.0.1:{replay}",
            )
        )
    for subscriber in subscribers:
        subscriber.start()
    try:
        for engine in engines:
            await until_heard(session, engine, index, tokenizer)
        yield index
    finally:
        for subscriber in subscribers:
            await subscriber.stop()


async def until_heard(
    session: aiohttp.ClientSession,
    engine: RealEngine,
    index: RecordingIndex,
    tokenizer: RequestTokenizer,
) -> None:
    """Send `engine` one-block prompts, each new to it, until `index` has a batch of it."""
    deadline = time.monotonic() + WAIT_S
    for n in itertools.count():
        await post(
            session,
            engine.url,
            Api.COMPLETIONS,
            completion(long_text(f"hello-{engine.port}-{n}", tokenizer, blocks=1)),
        )
        resend = time.monotonic() + 1.0
        while time.monotonic() < resend:
            if index.batches[engine.address]:
                return
            await asyncio.sleep(0.05)
        assert time.monotonic() < deadline, f"no KV events from {engine.address}"


@pytest.mark.parametrize("api", [Api.COMPLETIONS, Api.CHAT])
async def test_events_of_a_real_engine_give_the_chain_of_our_tokens(
    pool: EnginePool,
    own_view: RecordingIndex,
    tokenizer: RequestTokenizer,
    session: aiohttp.ClientSession,
    api: Api,
) -> None:
    prefill, _ = await pool.get("push")
    text = long_text(f"chain-{api.name}", tokenizer, blocks=4)
    if api is Api.COMPLETIONS:
        body, ours = completion(text), tokenizer.completion(text)
    else:
        messages = [{"role": "system", "content": text}, {"role": "user", "content": "Why?"}]
        body, ours = chat(messages), tokenizer.chat(messages)
    answer = await post(session, prefill.url, api, body)  # P serves it alone
    assert answer["usage"]["prompt_tokens"] == len(ours)
    full = len(ours) // BLOCK
    assert full >= 4, len(ours)
    await until(
        lambda: own_view.longest_prefix(ours)[prefill.address] == full,
        f"the index holding all {full} blocks of the prompt on P",
    )
    stored = own_view.stored[prefill.address]
    assert {e.block_size for e in stored} == {BLOCK}
    chain = stored_chain(stored, ours)
    assert len(chain) >= full
    for n, block in enumerate(chain[:full]):
        assert list(block) == ours[n * BLOCK : (n + 1) * BLOCK], f"block {n}"


# -- 2. routed to the engine that holds the prefix ---------------------------------------------


def kv_member(engine: RealEngine) -> dict[str, Any]:
    """A static endpoint with its own KV event ports (both engines share 127.0.0.1)."""
    return {"address": engine.address, "kv_events": engine.kv_events_endpoint}


def kv_pool(*engines: RealEngine) -> dict[str, Any]:
    return {"endpoints": [kv_member(e) for e in engines], "policy": "kv_cache", "kv_events": {}}


def fallback_choice(engines: list[RealEngine], api: Api, body: bytes) -> str:
    """Where the approximate fallback (prompt-start hashing) sends `body` among idle engines."""
    wanted = pick_request(parse_request(api, body, 1 << 20), None)
    return PrefixPicker().pick([EndpointState(e.address) for e in engines], wanted).address


async def sidecar_batches(setup: Setup, engine: RealEngine) -> float:
    """Batches of `engine` the sidecar has applied, live or replayed."""
    metrics = await scrape(setup.session, setup.sidecar.metrics + "/metrics")
    label = f'endpoint="{engine.address}"'
    return sum(
        v
        for k, v in metrics.items()
        if k.startswith(BATCHES + "{")
        and label in k
        and ('outcome="applied"' in k or 'outcome="replayed"' in k)
    )


async def until_sidecar_applied(setup: Setup, engine: RealEngine, batches: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while (applied := await sidecar_batches(setup, engine)) < batches:
        assert time.monotonic() < deadline, f"the sidecar applied {applied} batches, not {batches}"
        await asyncio.sleep(0.2)


async def queried_and_hits(
    session: aiohttp.ClientSession, engine: RealEngine
) -> tuple[float, float]:
    metrics = await engine_metrics(session, engine)
    return counter(metrics, QUERIED), counter(metrics, HITS)


def common_blocks(a: list[int], b: list[int]) -> int:
    same = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return same // BLOCK


@pytest_asyncio.fixture
async def both_decode(pool: EnginePool, session: aiohttp.ClientSession) -> AsyncIterator[Setup]:
    """The sidecar with both real engines as decode candidates under the kv_cache policy and
    every request decode-only, so each serves it alone from its own prefix cache. An engine
    may not be in both pools: a simulated P stands in as the prefill pool, unused (no probe)."""
    prefill, decode = await pool.get("push")
    async with running_engine(*FAST, "--kv-transfer-config", PUSH_P) as stand_in:
        pools = {
            "prefill": {"endpoints": [f"127.0.0.1:{stand_in.port}"]},
            "decode": kv_pool(prefill, decode),
        }
        async with sidecar_for(
            pool,
            "push",
            session,
            pools=pools,
            tokenizer=str(tiny_model()),
            decision={"mode": "threshold", "max_prompt_tokens": 4096},
            dispatch={"probe": False},
        ) as setup:
            await until_healthy(setup)
            yield setup


async def until_healthy(setup: Setup) -> None:
    """Every engine of the sidecar's pools healthy (else fewer candidates, and a pick right by
    chance)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        async with setup.session.get(setup.sidecar.metrics + "/ready?verbose") as response:
            ready = await response.json()
        members = {**ready["prefill"], **ready["decode"]}
        if all(m["healthy"] for m in members.values()):
            return
        assert time.monotonic() < deadline, f"engines not all healthy: {members}"
        await asyncio.sleep(0.2)


def conversation(tokenizer: RequestTokenizer, tag: str) -> tuple[list[dict[str, str]], ...]:
    """A chat's first turn (a system prompt of four blocks and more) and its next turn."""
    first = [
        {"role": "system", "content": long_text(tag, tokenizer, blocks=4)},
        {"role": "user", "content": "Who are you?"},
    ]
    later = [
        *first,
        {"role": "assistant", "content": "A model."},
        {"role": "user", "content": "And what do you hold?"},
    ]
    return first, later


async def test_a_prompt_goes_to_the_engine_holding_its_prefix(
    both_decode: Setup,
    own_view: RecordingIndex,
    tokenizer: RequestTokenizer,
    session: aiohttp.ClientSession,
) -> None:
    engines = [both_decode.prefill, both_decode.decode]
    first, later = conversation(tokenizer, "route")
    routed = orjson.dumps(chat(later))  # these bytes: the fallback hashes the raw JSON
    # the engine the fallback would not pick holds the prefix: only the index can find it
    holder = next(e for e in engines if e.address != fallback_choice(engines, Api.CHAT, routed))
    other = next(e for e in engines if e is not holder)
    await post(session, holder.url, Api.CHAT, chat(first))  # as another router would send it
    first_ids, later_ids = tokenizer.chat(first), tokenizer.chat(later)
    shared = common_blocks(first_ids, later_ids)
    assert shared >= 4, shared
    await until(
        lambda: own_view.longest_prefix(first_ids)[holder.address] == len(first_ids) // BLOCK,
        "the engine's events of the first turn",
    )
    await until_sidecar_applied(both_decode, holder, own_view.batches[holder.address])
    before = {e.address: await queried_and_hits(session, e) for e in engines}

    async with session.post(
        both_decode.sidecar.url + PATHS["chat"],
        data=routed,
        headers={"content-type": "application/json"},
    ) as response:
        assert response.status == 200, (await response.read())[-2000:]

    after = {e.address: await queried_and_hits(session, e) for e in engines}
    queried = {a: after[a][0] - before[a][0] for a in after}
    assert queried[other.address] == 0 and queried[holder.address] >= len(later_ids), queried
    hits = after[holder.address][1] - before[holder.address][1]
    assert hits >= shared * BLOCK, (hits, shared)


# -- 3. the next turn decode-only on the D that holds the conversation -------------------------

TURN = "turn"


def uncached_on_d(tokenizer: RequestTokenizer) -> tuple[int, int, int]:
    """The first turn's tokens, the blocks both turns share, and the next turn's tokens beyond
    them (what D computes alone once it holds the first turn)."""
    first, later = conversation(tokenizer, TURN)
    first_ids, later_ids = tokenizer.chat(first), tokenizer.chat(later)
    shared = common_blocks(first_ids, later_ids)
    return len(first_ids), shared, len(later_ids) - shared * BLOCK


@pytest_asyncio.fixture
async def pd_by_cache(
    pool: EnginePool, session: aiohttp.ClientSession, tokenizer: RequestTokenizer
) -> AsyncIterator[Setup]:
    """The pair behind the sidecar, both pools kv_cache, and decode-only for a prompt of which
    D lacks at most what the next turn adds: the first turn, all new to D, goes P/D."""
    prefill, decode = await pool.get("push")
    first_tokens, _, beyond = uncached_on_d(tokenizer)
    assert first_tokens > beyond + 8, (first_tokens, beyond)
    pools = {"prefill": kv_pool(prefill), "decode": kv_pool(decode)}
    async with sidecar_for(
        pool,
        "push",
        session,
        pools=pools,
        tokenizer=str(tiny_model()),
        decision={"mode": "threshold", "max_prompt_tokens": beyond + 8},
        dispatch={"probe": False},
    ) as setup:  # P serves no request but ours
        await until_healthy(setup)
        yield setup


async def test_the_next_turn_goes_decode_only_to_the_d_holding_the_first(
    pd_by_cache: Setup,
    own_view: RecordingIndex,
    tokenizer: RequestTokenizer,
    session: aiohttp.ClientSession,
) -> None:
    prefill, decode = pd_by_cache.prefill, pd_by_cache.decode
    first, later = conversation(tokenizer, TURN)
    first_ids = tokenizer.chat(first)
    _, shared, _ = uncached_on_d(tokenizer)
    p_before = await queried_and_hits(session, prefill)
    status, raw = await pd_by_cache.post(PATHS["chat"], chat(first))
    assert status == 200, raw[-2000:]
    assert (await queried_and_hits(session, prefill))[0] > p_before[0], "the first turn not P/D"
    # D holds the first turn's blocks, pushed from P: its events say so
    await until(
        lambda: own_view.longest_prefix(first_ids)[decode.address] >= shared,
        "D's events of the first turn's blocks",
    )
    await until_sidecar_applied(pd_by_cache, decode, own_view.batches[decode.address])
    before = {e.address: await queried_and_hits(session, e) for e in (prefill, decode)}

    status, raw = await pd_by_cache.post(PATHS["chat"], chat(later))
    assert status == 200, raw[-2000:]

    after = {e.address: await queried_and_hits(session, e) for e in (prefill, decode)}
    assert after[prefill.address][0] == before[prefill.address][0], "the next turn went to P"
    hits = after[decode.address][1] - before[decode.address][1]
    assert hits >= shared * BLOCK, (hits, shared)
