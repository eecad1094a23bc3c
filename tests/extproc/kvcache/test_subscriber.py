"""An engine's KV events over real ZMQ sockets on 127.0.0.1: in-order batches, gaps filled by
replay from a ROUTER serving vLLM's protocol, gaps that cannot be filled, restarts, malformed
messages, a flood, and the set of subscribers following the pools' membership. Then a hostile
publisher: oversized and large batches, a flood, a flooding replay socket and every malformed
shape hold the event loop under 0.25 s and leave the subscriber alive; a subscriber that fails
is restarted; a reset between two slices of a batch ends that batch."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from extproc.kvcache.index import KvIndex
from extproc.kvcache.subscriber import EngineEvents, SubscriberLimits
from extproc.kvcache.watchers import EventSource, KvEventWatchers
from extproc.metrics import Metrics
from extproc.stopping import cancel_and_wait
from tests.extproc.kvcache.kv_events_helpers import (
    FakeEngine,
    batch,
    chain,
    cleared,
    joined,
    removed,
    stored,
)
from tests.support.polling import until, until_true

TOKENS = list(range(1, 33))


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)  # a failed test's sockets too: term() would wait on them


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


# -- a hostile or broken publisher -------------------------------------------------------------

STALL_BOUND_S = 0.25  # the longest the event loop may be held (the bound)


@dataclass
class Lateness:
    worst: float = 0.0  # the longest stall
    total: float = 0.0  # all stalls together


@contextlib.asynccontextmanager
async def loop_lateness() -> AsyncIterator[Lateness]:
    """The event loop's stalls while the block runs: a task asks to wake every 5 ms and
    records how late it woke (as a small request beside the events would wait)."""
    late = Lateness()

    async def tick() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            lateness = time.perf_counter() - before - 0.005
            late.worst, late.total = max(late.worst, lateness), late.total + lateness

    task = asyncio.create_task(tick())
    await asyncio.sleep(0)
    try:
        yield late
    finally:
        await cancel_and_wait([task])


async def counted(metric: Any, labels: tuple[str, ...], n: float) -> None:
    await until_true(lambda: count(metric, *labels) >= n, f"{labels} counted {n}", 20)


def many_events(n: int) -> bytes:
    """`n` BlockStored of two blocks each, every one a prompt of its own (vLLM sends one per
    request and step)."""
    return batch(*(chain(1000 + 2 * i, [i % 50_000 + t for t in range(8)]) for i in range(n)))


def long_events(events: int, tokens: int = 1 << 18, size: int = 16) -> bytes:
    """`events` BlockStored of `tokens` each (the longest an event may be), one chain."""
    blocks = tokens // size
    return batch(
        *(
            stored(
                list(range(1000 + n * blocks, 1000 + (n + 1) * blocks)),
                999 + n * blocks if n else None,
                [(t + n) % 50_000 for t in range(tokens)],
                block_size=size,
            )
            for n in range(events)
        )
    )


async def holding_blocks(engine: FakeEngine, events: EngineEvents, metrics: Metrics) -> float:
    """The subscriber joined and the engine's first 4 blocks indexed; the applied count."""
    await joined(engine, events)
    base = count(metrics.kv_event_batches, "e", "applied")
    await engine.send(batch(chain(1, TOKENS[:16])))
    await applied(events, metrics, base + 1)
    return base + 1


async def test_an_oversized_batch_is_counted_dropped_and_resets_the_engine(
    engine: FakeEngine, ctx: Any
) -> None:
    oversized = many_events(64_000)  # 8.7 MB: over the 8 MiB bound, under ZMQ's 16 MiB
    assert (
        SubscriberLimits().max_batch_bytes < len(oversized) < SubscriberLimits().max_message_bytes
    )
    async with subscribed(engine, ctx, max_blocks=200_000) as (events, index, metrics):
        done = await holding_blocks(engine, events, metrics)
        async with loop_lateness() as late:
            await engine.send(oversized)
            await counted(metrics.kv_event_batches, ("e", "oversized"), 1)
        assert late.worst < STALL_BOUND_S
        assert count(metrics.kv_index_resets, "e", "oversized") == 1
        assert index.longest_prefix(TOKENS) == {"e": 0}  # what it said is lost: as a gap
        await engine.send(batch(chain(5, TOKENS[:8])))
        await applied(events, metrics, done + 1)  # alive
        assert index.longest_prefix(TOKENS) == {"e": 2}


@pytest.mark.parametrize(
    ("payload", "blocks"),
    [(lambda: many_events(30_000), 60_000), (lambda: long_events(4), 1 << 16)],
    ids=["30000_events", "a_million_tokens"],
)
async def test_a_large_batch_is_applied_in_slices_without_stalling_the_loop(
    engine: FakeEngine, ctx: Any, payload: Callable[[], bytes], blocks: int
) -> None:
    large = payload()
    async with subscribed(engine, ctx, max_blocks=1 << 19) as (events, index, metrics):
        done = await holding_blocks(engine, events, metrics)
        async with loop_lateness() as late:
            await engine.send(large)
            await applied(events, metrics, done + 1)
        assert late.worst < STALL_BOUND_S
        assert index.blocks == 4 + blocks  # all of it, the long chain across its slices


async def test_a_flood_of_large_batches_holds_the_loop_for_its_share_only(
    engine: FakeEngine, ctx: Any
) -> None:
    """1 MB batches, more than the loop can apply: the subscriber spends at most its share of
    each second on them (sleeping out the rest), so the process is far from a whole core."""
    limits = SubscriberLimits(loop_share=0.1)
    flood = [many_events(5_000) for _ in range(3)]
    async with subscribed(engine, ctx, max_blocks=1 << 19, limits=limits) as (
        events,
        _,
        metrics,
    ):
        done = await holding_blocks(engine, events, metrics)
        async with loop_lateness() as late:
            for n in range(40):
                await engine.send(flood[n % 3])
            await applied(events, metrics, done + 1)
            wall, held = time.perf_counter(), late.total
            await asyncio.sleep(3)
            share = (late.total - held) / (time.perf_counter() - wall)
        assert late.worst < STALL_BOUND_S
        assert share < 0.4  # about 0.1 of the loop's time held; without the budget all of it
        assert count(metrics.kv_event_batches, "e", "applied") < done + 40  # still paced


# A replay socket that answers every request with an endless stream of batches older than
# asked for (and never an end), from a process of its own, faster than they can be read. It
# ends by itself after a minute, should the test not end it.
_FLOODER = """
import sys, time, zmq
router = zmq.Context().socket(zmq.ROUTER)
router.bind("tcp://127.0.0.1:*")
print(router.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
old, seq, client, end = bytes.fromhex(sys.argv[1]), (0).to_bytes(8, "big"), None, time.time() + 60
while time.time() < end:
    if router.poll(0 if client else 100):
        client = router.recv_multipart()[0]
    for _ in range(1000 if client else 0):
        try:
            router.send_multipart([client, b"", b"", seq, old], flags=zmq.NOBLOCK)
        except zmq.Again:
            break
"""


@contextlib.asynccontextmanager
async def flooding_replay() -> AsyncIterator[str]:
    """The flooder's endpoint, while it runs."""
    flooder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FLOODER, batch().hex(), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert flooder.stdout is not None
        async with asyncio.timeout(10):
            yield (await flooder.stdout.readline()).decode().strip()
    finally:
        flooder.kill()
        await asyncio.wait_for(flooder.wait(), 10)


async def test_a_replay_flooding_old_batches_neither_stalls_the_loop_nor_outlasts_its_bound(
    engine: FakeEngine, ctx: Any
) -> None:
    limits = SubscriberLimits(replay_timeout_s=1.0)
    async with (
        flooding_replay() as endpoint,
        subscribed(engine, ctx, replay_endpoint=endpoint, limits=limits) as (
            events,
            index,
            metrics,
        ),
    ):
        engine.seq = 5  # so that the joiner asks for the batches before: a flood too
        await joined(engine, events)
        await counted(metrics.kv_event_replays, ("e", "failed"), 1)
        await engine.send(batch(chain(1, TOKENS[:16])))
        base = count(metrics.kv_event_batches, "e", "applied")
        async with loop_lateness() as late:
            await engine.send(batch(), lost=True)
            started = time.perf_counter()
            await engine.send(batch(chain(5, TOKENS[:8])))  # a gap: the replay floods
            await counted(metrics.kv_event_replays, ("e", "failed"), 2)
            waited = time.perf_counter() - started
            await applied(events, metrics, base + 1)
        assert late.worst < STALL_BOUND_S
        assert waited < limits.replay_timeout_s + 1.0
        assert count(metrics.kv_index_resets, "e", "gap") >= 1
        assert index.longest_prefix(TOKENS) == {"e": 2}  # only what came after the gap


MALFORMED = {
    "extra_keys_an_int": stored([9], None, [1, 2, 3, 4], extra_keys=7),
    "extra_keys_a_string": stored([9], None, [1, 2, 3, 4], extra_keys="salt"),
    "token_ids_dicts": stored([9], None, [{"a": 1}] * 4),
    "token_id_over_64_bits": stored([9], None, [1, 2, 3, 2**64 - 1]),
    "token_id_negative": stored([9], None, [1, 2, 3, -(2**63)]),
    "block_size_a_list": stored([9], None, [1, 2, 3, 4], block_size=[4]),
    "hashes_nested": stored([[9, [9]]], None, [1, 2, 3, 4]),
    "parent_a_map": stored([9], {"x": [1]}, [1, 2, 3, 4]),
    "tag_array_of_garbage": ["BlockStored", {"a": [None]}, [[]], "x", 4],
    "tag_not_a_string": [7, [1], None],
    "event_a_number": 3.5,
}


@pytest.mark.parametrize("event", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_batch_resets_the_engine_and_the_subscriber_lives_on(
    engine: FakeEngine, ctx: Any, event: Any
) -> None:
    async with subscribed(engine, ctx) as (events, index, metrics):
        done = await holding_blocks(engine, events, metrics)
        await engine.send(batch(removed([2]), event))
        await counted(metrics.kv_event_batches, ("e", "malformed"), 1)
        assert count(metrics.kv_index_resets, "e", "malformed") == 1
        assert index.longest_prefix(TOKENS) == {"e": 0}
        await engine.send(batch(chain(5, TOKENS[:8])))
        await applied(events, metrics, done + 1)
        assert index.longest_prefix(TOKENS) == {"e": 2}
        assert count(metrics.kv_event_subscriber_restarts, "e") == 0


async def test_a_subscriber_that_fails_is_restarted_with_its_entries_dropped(
    engine: FakeEngine, ctx: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    limits = SubscriberLimits(restart_backoff_s=0.05)
    async with subscribed(engine, ctx, limits=limits) as (events, index, metrics):
        await holding_blocks(engine, events, metrics)
        apply = index.apply

        def fails_once(engine_name: str, batch_events: Any) -> None:
            monkeypatch.setattr(index, "apply", apply)
            raise RuntimeError("a bug")

        monkeypatch.setattr(index, "apply", fails_once)
        await engine.send(batch(chain(50, TOKENS[:4])))
        await counted(metrics.kv_event_subscriber_restarts, ("e",), 1)
        assert index.longest_prefix(TOKENS) == {"e": 0}
        failed = [r for r in caplog.records if "subscriber failed" in r.getMessage()]
        assert len(failed) == 1 and "RuntimeError: a bug" in failed[0].getMessage()
        assert failed[0].exc_info is None  # one line, no traceback
        # a new subscriber, which asks the replay what it missed once it hears the engine
        # (`joined` would not wait for it: `applied` is still set from the first one)

        async def replayed() -> bool:
            await engine.send(batch())
            return index.longest_prefix(TOKENS) == {"e": 4}

        await until(replayed, "the replay of what the failed subscriber missed", 20)


@pytest.mark.parametrize("reset", ["cleared", "removed"])
async def test_a_batch_whose_engine_is_reset_midway_is_not_applied_past_the_reset(
    engine: FakeEngine, ctx: Any, reset: str
) -> None:
    """Slices of one batch, and between two of them another task drops the engine (its
    restart seen, or it left the pool): the rest of the batch is not applied, as if the reset
    came after the whole batch."""
    limits = SubscriberLimits(slice_blocks=4)
    async with subscribed(engine, ctx, limits=limits) as (events, index, metrics):
        await joined(engine, events)
        base = count(metrics.kv_event_batches, "e", "applied")

        async def reset_after_the_first_slice() -> None:
            while index.blocks == 0:  # noqa: ASYNC110 (to run between two slices, not later)
                await asyncio.sleep(0)
            index.clear_engine("e") if reset == "cleared" else index.remove_engine("e")

        resetting = asyncio.create_task(reset_after_the_first_slice())
        await engine.send(many_events(200))  # 200 prompts of their own: 100 slices
        await applied(events, metrics, base + 1)
        await resetting
        assert index.blocks == 0
        assert ("e" in index.engines()) == (reset == "cleared")


async def test_an_engine_on_an_ipv6_address_is_followed_and_replayed(ctx: Any) -> None:
    """ZMQ's sockets speak IPv4 only unless told: the subscriber and its replay must not."""
    engine = FakeEngine(ctx, host="::1")
    try:
        await engine.send(batch(chain(1, TOKENS[:8])), lost=True)  # only the replay has it
        async with subscribed(engine, ctx) as (events, index, _):
            await joined(engine, events)  # the subscriber reads the engine's PUB
            held = lambda: index.longest_prefix(TOKENS) == {"e": 2}  # noqa: E731
            await until_true(held, "the replayed batch indexed")
            assert engine.endpoint.startswith("tcp://[::1]:") and engine.replays
    finally:
        await engine.close()


async def test_a_subscriber_without_a_context_of_its_own_uses_its_limits_and_restarts(
    engine: FakeEngine,
) -> None:
    """As the sidecar makes them: on ZMQ's shared context, with the limits it was given."""
    index, metrics = KvIndex(max_blocks=100), Metrics()
    limits = SubscriberLimits(max_batch_bytes=64)  # an empty batch fits, a stored block not
    events = EngineEvents("e", engine.endpoint, index, metrics, limits=limits)
    try:
        for _ in range(2):  # started again after a stop
            events.start()
            await joined(engine, events)
            oversized = count(metrics.kv_event_batches, "e", "oversized")
            await engine.send(batch(chain(1, TOKENS[:16])))
            await counted(metrics.kv_event_batches, ("e", "oversized"), oversized + 1)
            await events.stop()
    finally:
        await events.stop()
