"""An engine's KV events over real ZMQ sockets on 127.0.0.1: in-order batches, gaps filled by
replay from a ROUTER serving vLLM's protocol, gaps that cannot be filled, restarts, malformed
messages, a flood, and the set of subscribers following the pools' membership."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from extproc.kvcache.index import KvIndex
from extproc.kvcache.subscriber import EngineEvents, SubscriberLimits
from extproc.kvcache.watchers import EventSource, KvEventWatchers
from extproc.metrics import Metrics
from tests.extproc.kvcache.kv_events_helpers import (
    FakeEngine,
    batch,
    chain,
    cleared,
    joined,
    removed,
)

TOKENS = list(range(1, 33))


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


@pytest_asyncio.fixture
async def engine(ctx: zmq.asyncio.Context) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(ctx)
    yield fake
    await fake.close()


@contextlib.asynccontextmanager
async def subscribed(
    engine: FakeEngine, ctx: zmq.asyncio.Context, **kw: Any
) -> AsyncIterator[tuple[EngineEvents, KvIndex, Metrics]]:
    index, metrics = KvIndex(max_blocks=kw.pop("max_blocks", 10_000)), Metrics()
    events = EngineEvents(
        "e",
        engine.endpoint,
        index,
        metrics,
        context=ctx,
        replay_endpoint=kw.pop("replay_endpoint", engine.replay_endpoint),
        **kw,
    )
    events.start()
    try:
        yield events, index, metrics
    finally:
        await events.stop()


async def applied(events: EngineEvents, metrics: Metrics, n: float) -> None:
    async with asyncio.timeout(10):
        while metrics.kv_event_batches.labels("e", "applied")._value.get() < n:
            events.applied.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(events.applied.wait(), 0.05)


def count(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


async def test_batches_in_order_build_the_index(engine: FakeEngine, ctx: Any) -> None:
    async with subscribed(engine, ctx) as (events, index, metrics):
        await joined(engine, events)
        base = count(metrics.kv_event_batches, "e", "applied")
        await engine.send(batch(chain(1, TOKENS[:16]), ts=1.0))
        await engine.send(batch(removed([4])))
        await applied(events, metrics, base + 2)
        assert index.longest_prefix(TOKENS) == {"e": 3}
        assert metrics.kv_index_blocks._value.get() == 3
        assert metrics.kv_event_lag_seconds._sum.get() > 0  # ts 1.0 is long ago


async def test_a_joiner_learns_what_it_missed_from_the_replay(engine: FakeEngine, ctx: Any) -> None:
    await engine.send(batch(chain(1, TOKENS[:8])))  # before anyone subscribed
    async with subscribed(engine, ctx) as (events, index, metrics):
        await joined(engine, events)
        assert engine.replays == [0]
        assert index.longest_prefix(TOKENS) == {"e": 2}
        assert count(metrics.kv_event_replays, "e", "filled") == 1


async def test_a_gap_is_filled_by_replay(engine: FakeEngine, ctx: Any) -> None:
    async with subscribed(engine, ctx) as (events, index, metrics):
        await joined(engine, events)
        base = count(metrics.kv_event_batches, "e", "applied")
        await engine.send(batch(chain(1, TOKENS[:16])))
        gap_at = await engine.send(batch(removed([3])), lost=True)
        await engine.send(batch(chain(100, TOKENS[16:20], parent=2)), lost=True)
        await engine.send(batch())
        await applied(events, metrics, base + 2)
        assert engine.replays[-1] == gap_at
        assert count(metrics.kv_event_gaps, "e") == 1
        assert count(metrics.kv_event_replays, "e", "filled") >= 1
        assert count(metrics.kv_event_batches, "e", "replayed") >= 2
        assert index.longest_prefix(TOKENS) == {"e": 2}  # the lost removal was applied


async def test_a_gap_the_replay_cannot_fill_resets_the_engine(ctx: Any) -> None:
    engine = FakeEngine(ctx, keep=1)  # its buffer forgets all but the last batch
    try:
        async with subscribed(engine, ctx) as (events, index, metrics):
            await joined(engine, events)  # (its replay had nothing older than what arrived)
            base = count(metrics.kv_event_batches, "e", "applied")
            shorts = count(metrics.kv_event_replays, "e", "short")
            await engine.send(batch(chain(1, TOKENS[:16])))
            await engine.send(batch(removed([3])), lost=True)
            await engine.send(batch(), lost=True)
            await engine.send(batch(chain(50, TOKENS[:4])))
            await applied(events, metrics, base + 2)
            assert count(metrics.kv_event_replays, "e", "short") == shorts + 1
            assert count(metrics.kv_index_resets, "e", "gap") == 1
            assert index.longest_prefix(TOKENS) == {"e": 1}  # only what came after the gap
    finally:
        await engine.close()


@pytest.mark.parametrize("why", ["no_replay_endpoint", "no_answer"])
async def test_a_gap_without_a_replay_resets_the_engine(
    engine: FakeEngine, ctx: Any, why: str
) -> None:
    options: dict[str, Any] = {"limits": SubscriberLimits(replay_timeout_s=0.3)}
    if why == "no_replay_endpoint":
        options["replay_endpoint"] = None
    async with subscribed(engine, ctx, **options) as (events, index, metrics):
        await joined(engine, events)
        engine.answer_replays = False
        base = count(metrics.kv_event_batches, "e", "applied")
        outcome = "skipped" if why == "no_replay_endpoint" else "failed"
        before = count(metrics.kv_event_replays, "e", outcome)
        await engine.send(batch(chain(1, TOKENS[:16])))
        await engine.send(batch(), lost=True)
        await engine.send(batch())
        await applied(events, metrics, base + 2)
        assert count(metrics.kv_event_replays, "e", outcome) == before + 1
        assert count(metrics.kv_index_resets, "e", "gap") == 1
        assert index.longest_prefix(TOKENS) == {"e": 0}


async def test_an_engine_restart_clears_it(engine: FakeEngine, ctx: Any) -> None:
    async with subscribed(engine, ctx) as (events, index, metrics):
        await joined(engine, events)
        base = count(metrics.kv_event_batches, "e", "applied")
        await engine.send(batch(chain(1, TOKENS[:16])))
        await applied(events, metrics, base + 1)
        engine.seq = 0  # a new engine process numbers from 0 again
        await engine.send(batch(chain(9, TOKENS[:4])))
        await applied(events, metrics, base + 2)
        assert count(metrics.kv_index_resets, "e", "restart") == 1
        assert index.longest_prefix(TOKENS) == {"e": 1}
        await engine.send(batch(cleared()))
        await applied(events, metrics, base + 3)
        assert count(metrics.kv_index_resets, "e", "cleared") == 1
        assert index.longest_prefix(TOKENS) == {"e": 0}


async def test_malformed_messages_are_counted_and_skipped(engine: FakeEngine, ctx: Any) -> None:
    async with subscribed(engine, ctx) as (events, index, metrics):
        await joined(engine, events)
        base = count(metrics.kv_event_batches, "e", "applied")
        await engine.pub.send_multipart([b"", b"\x00\x01"])  # two frames
        await engine.pub.send_multipart([b"", b"short", b"x"])  # a 5-byte sequence number
        await engine.send(batch(chain(1, TOKENS[:8])))
        await engine.send(b"\xc1 not msgpack")  # a batch lost: the engine's entries go
        await engine.send(batch(chain(5, TOKENS[:4])))
        await applied(events, metrics, base + 2)
        assert count(metrics.kv_event_batches, "e", "malformed") == 3
        assert count(metrics.kv_index_resets, "e", "malformed") == 1
        assert count(metrics.kv_event_gaps, "e") == 0
        assert index.longest_prefix(TOKENS) == {"e": 1}


async def test_a_flood_stays_within_the_bound_and_its_budget(engine: FakeEngine, ctx: Any) -> None:
    limits = SubscriberLimits(receive_hwm=100, batches_per_s=1000)
    async with subscribed(engine, ctx, max_blocks=500, limits=limits) as (events, index, metrics):
        started = time.monotonic()  # before the budget's first second began
        await joined(engine, events)
        for n in range(3000):  # 24 000 blocks, faster than the budget lets them in
            await engine.send(batch(chain(10 + 8 * n, [n % 97 + t for t in range(32)])))
            if n % 100 == 0:
                await asyncio.sleep(0)
        await applied(events, metrics, 1200)
        assert time.monotonic() - started >= 1.0  # 1000 batches a second at most
        assert index.blocks <= 500


async def test_watchers_follow_the_membership(ctx: Any) -> None:
    a, b = FakeEngine(ctx), FakeEngine(ctx)
    index, metrics = KvIndex(max_blocks=1000), Metrics()
    watchers = KvEventWatchers(index, metrics, context=ctx)
    try:
        sources = {
            name: EventSource(e.endpoint, e.replay_endpoint) for name, e in (("a", a), ("b", b))
        }
        await watchers.set_sources(sources)
        for name, fake in (("a", a), ("b", b)):
            await fake.send(batch(chain(1, TOKENS[:8])))
            await joined(fake, watchers._watching[name][1])
        assert index.longest_prefix(TOKENS) == {"a": 2, "b": 2}
        scraped = metrics.render().decode()
        assert 'pd_extproc_kv_event_batches_total{endpoint="b"' in scraped

        await watchers.set_sources({"a": sources["a"]})  # b left the pool
        assert index.engines() == ["a"] and index.blocks == 2
        assert 'endpoint="b"' not in metrics.render().decode()

        moved = EventSource(b.endpoint, b.replay_endpoint)  # a now publishes elsewhere
        await watchers.set_sources({"a": moved})
        assert index.longest_prefix(TOKENS) == {"a": 0}  # what it held is unknown again
        await joined(b, watchers._watching["a"][1])
        assert index.longest_prefix(TOKENS) == {"a": 2}  # b's replay, now under a's name
        tasks = [events._task for _, events in watchers._watching.values()]
    finally:
        await watchers.stop()
        await a.close()
        await b.close()
    assert watchers.sources() == {} and index.engines() == []
    assert all(task is not None and task.done() for task in tasks)
