"""Engines that connect to the sidecar (llm-d's topology), over real ZMQ sockets on 127.0.0.1:
a batch is indexed under the member its topic names (by IP or ip:port, each data-parallel rank on
the port plus its rank); the first batch seen starts the stream (ZMQ's slow joiner loses the
ones before); a gap without a replay resets the engine; and a hostile publisher (topics naming
no member, malformed messages, oversized batches, a flood) indexes nothing of its own, is counted
and holds the event loop under 0.25 s."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
import zmq
import zmq.asyncio

from extproc.kvcache.index import KvIndex
from extproc.kvcache.listener import EventListener, Listened, _same_ip, topic_who
from extproc.kvcache.stream import SubscriberLimits
from extproc.kvcache.watchers import EventSource, KvEventWatchers
from extproc.metrics import Metrics
from extproc.stopping import cancel_and_wait
from tests.extproc.kvcache.kv_events_helpers import batch, chain
from tests.support.engines import two_free_ports
from tests.support.polling import until, until_true

TOKENS = list(range(1, 33))
MEMBER = "127.0.0.7:8000"
STALL_BOUND_S = 0.25


@pytest_asyncio.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)  # a failed test's sockets too: term() would wait on them


@contextlib.asynccontextmanager
async def listening(
    ctx: zmq.asyncio.Context,
    engines: dict[str, Listened],
    relay: str | None = None,
    limits: SubscriberLimits | None = None,
) -> AsyncIterator[tuple[EventListener, KvIndex, Metrics]]:
    index, metrics = KvIndex(max_blocks=10_000), Metrics()
    # a port whose next is free too: rank 1 listens on the port plus one (with port 0, on the
    # ephemeral port rank 0 got plus one, which another socket may hold)
    port = two_free_ports()
    listener = EventListener(
        "127.0.0.1", port, index, metrics, context=ctx, relay=relay, limits=limits
    )
    await listener.set_engines(engines)
    try:
        yield listener, index, metrics
    finally:
        await listener.stop()


class Publisher:
    """A vLLM publisher whose endpoint names a host: its PUB socket connects, with a topic,
    from the loopback address `source` (by default the IP the topic names, as an engine
    would)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        topic: str,
        seq: int = 0,
        source: str | None = None,
    ):
        named = topic_who(topic.encode())
        if source is None:
            ip = named[0].split(":")[0] if named else ""
            source = ip if ip.startswith("127.") else "127.0.0.1"
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(f"tcp://{source}:0;{endpoint.removeprefix('tcp://')}")
        self.topic = topic.encode()
        self.seq = seq

    async def send(self, payload: bytes) -> None:
        seq, self.seq = self.seq, self.seq + 1
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def close(self) -> None:
        self.pub.close(linger=0)


class Flood:
    """A socket the receiver reads `messages` from as fast as it can, then nothing."""

    def __init__(self, messages: list[list[bytes]]) -> None:
        self.messages = messages
        self.idle = asyncio.Event()  # every message was taken

    async def poll(self, **_: int) -> int:
        if not self.messages:
            self.idle.set()
            await asyncio.Event().wait()
        return 1

    async def recv_multipart(self) -> list[bytes]:
        return self.messages.pop(0)


def count(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


def held(index: KvIndex, tokens: list[int] = TOKENS) -> dict[str, int]:
    """Per engine that holds any: its leading blocks of `tokens`."""
    return {engine: n for engine, n in index.longest_prefix(tokens).items() if n}


async def until_indexed(pub: Publisher, index: KvIndex, engine: str, blocks: int = 4) -> None:
    """Publish the prompt's blocks until the engine holds them (the first batches of a
    connecting publisher are lost while it joins)."""
    async with asyncio.timeout(10):
        while held(index, TOKENS[: 4 * blocks]).get(engine) != blocks:
            await pub.send(batch(chain(1, TOKENS[: 4 * blocks])))
            await asyncio.sleep(0.02)


def test_topics_name_who_and_model() -> None:
    assert topic_who(b"kv@127.0.0.7@meta-llama/Llama-3.1-8B") == (
        "127.0.0.7",
        "meta-llama/Llama-3.1-8B",
    )
    assert topic_who(b"kv@fd00::1@m") == ("fd00::1", "m")
    assert topic_who(b"kv@127.0.0.7@org/m@v2") == ("127.0.0.7", "org/m@v2")  # "@" in a model
    assert topic_who(b"kv@h@" + b"m" * 507) == ("h", "m" * 507)  # 512 bytes: the most taken
    for other in (b"", b"kv", b"kv@@m", b"ev@127.0.0.7@m", b"kv@\xff@m", b"kv@h@" + b"m" * 508):
        assert topic_who(other) is None


async def test_an_engine_that_connects_is_indexed_under_the_member_its_topic_names(
    ctx: Any,
) -> None:
    engines = {MEMBER: Listened(MEMBER), "127.0.0.8:8000": Listened("127.0.0.8:8000")}
    async with listening(ctx, engines) as (listener, index, metrics):
        pub = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@some-model", seq=40)
        try:
            await until_indexed(pub, index, MEMBER)
            assert held(index) == {MEMBER: 4}
            # joined at 40 (the slow joiner lost what came before): a start, not a gap
            assert count(metrics.kv_index_resets, MEMBER, "gap") == 0
            pub.seq += 3  # three batches lost on the way, and no replay socket to ask
            await pub.send(batch())
            await until_true(lambda: count(metrics.kv_index_resets, MEMBER, "gap") == 1, "gap")
            assert held(index) == {}
        finally:
            pub.close()


async def test_engines_sharing_a_host_are_told_apart_by_address_and_model(ctx: Any) -> None:
    engines = {
        "127.0.0.7:8000": Listened("127.0.0.7:8000", "a"),
        "127.0.0.7:8001": Listened("127.0.0.7:8001", "b"),
    }
    async with listening(ctx, engines) as (listener, index, _):
        by_address = Publisher(ctx, listener.bound[0], "kv@127.0.0.7:8001@whatever")
        by_model = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@a")
        try:
            await until_indexed(by_address, index, "127.0.0.7:8001")
            await until_indexed(by_model, index, "127.0.0.7:8000")
        finally:
            by_address.close()
            by_model.close()


async def test_a_data_parallel_rank_connects_to_the_port_plus_its_rank(ctx: Any) -> None:
    engines = {f"{MEMBER} dp{r}": Listened(MEMBER, rank=r) for r in (0, 1)}
    async with listening(ctx, engines) as (listener, index, _):
        base = int(listener.bound[0].rpartition(":")[2])
        assert listener.bound[1].endswith(f":{base + 1}")
        pub = Publisher(ctx, listener.bound[1], "kv@127.0.0.7@m")
        try:
            await until_indexed(pub, index, f"{MEMBER} dp1")
            assert held(index) == {f"{MEMBER} dp1": 4}
        finally:
            pub.close()


async def test_a_hostile_publisher_indexes_nothing_is_counted_and_does_not_stall_the_loop(
    ctx: Any,
) -> None:
    async with listening(ctx, {MEMBER: Listened(MEMBER)}) as (
        listener,
        index,
        metrics,
    ):
        engine = Publisher(ctx, listener.bound[0], f"kv@{MEMBER}@m")
        hostile = Publisher(ctx, listener.bound[0], "kv@10.6.6.6@m")
        try:
            await until_indexed(engine, index, MEMBER)
            worst = 0.0
            stop = asyncio.Event()

            async def tick() -> None:
                nonlocal worst
                while not stop.is_set():
                    before = time.perf_counter()
                    await asyncio.sleep(0.005)
                    worst = max(worst, time.perf_counter() - before - 0.005)

            ticker = asyncio.create_task(tick())
            big = batch(*(chain(10_000 + 2 * i, [i + t for t in range(8)]) for i in range(4000)))
            for _ in range(30):  # a flood of large batches naming no member
                await hostile.send(big)
            for _ in range(2000):  # and of small ones, and of wrong shapes
                await hostile.send(batch(chain(500, TOKENS[:8])))
                await hostile.raw([b"kv@10.6.6.6@m", b"x"])
                await hostile.raw([b"not-a-topic", b"\0" * 8, b"x"])
            # a large batch of the engine's own, applied in slices between which the loop runs
            await engine.send(
                batch(*(chain(10**6 + 2 * i, [i + t for t in range(8)]) for i in range(20_000)))
            )
            await engine.send(b"\xc1")  # a malformed batch from the engine itself
            await engine.send(b"\0" * (9 << 20))  # and an oversized one
            # ZMQ drops what overflows its queues: some of each arrive, not all
            await until_true(
                lambda: (
                    count(metrics.kv_event_batches, MEMBER, "oversized") == 1
                    and count(metrics.kv_event_unattributed, "unknown_topic") >= 20
                    and count(metrics.kv_event_unattributed, "malformed") >= 20
                ),
                "the hostile messages counted",
                20,
            )
            stop.set()
            await cancel_and_wait([ticker])
            assert worst < STALL_BOUND_S, worst
            assert count(metrics.kv_event_batches, MEMBER, "malformed") == 1
            assert index.engines() == [MEMBER]  # the hostile topic made no engine
            assert held(index, TOKENS[:8]) == {}  # its blocks went nowhere
            await until_indexed(engine, index, MEMBER)  # the engine's stream lives on
        finally:
            engine.close()
            hostile.close()


async def test_a_batch_under_a_members_topic_counts_only_from_that_members_ip(
    ctx: Any,
) -> None:
    async with listening(ctx, {MEMBER: Listened(MEMBER)}) as (listener, index, metrics):
        impostor = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m", source="127.0.0.1")
        engine = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m")
        try:

            async def dropped() -> bool:  # sent until one arrives (the slow joiner)
                await impostor.send(batch(chain(500, TOKENS[:8])))
                return count(metrics.kv_event_unattributed, "wrong_sender") >= 1

            await until(dropped, "the impostor's batch dropped")
            assert held(index, TOKENS[:8]) == {}
            await until_indexed(engine, index, MEMBER)  # the member itself still counts
        finally:
            impostor.close()
            engine.close()


async def test_without_the_sender_check_a_batch_is_taken_by_its_topic_alone(ctx: Any) -> None:
    index, metrics = KvIndex(max_blocks=10_000), Metrics()
    listener = EventListener("127.0.0.1", 0, index, metrics, context=ctx, check_sender=False)
    await listener.set_engines({MEMBER: Listened(MEMBER)})
    behind_a_proxy = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m", source="127.0.0.1")
    try:
        await until_indexed(behind_a_proxy, index, MEMBER)
    finally:
        behind_a_proxy.close()
        await listener.stop()


async def test_a_process_that_does_not_listen_reads_what_the_listening_one_relays(
    ctx: Any, tmp_path: Any
) -> None:
    """`extproc.workers`: one process binds and relays what it attributed (with the rank);
    another reads it, attributing it again, and binds nothing."""
    relay = f"ipc://{tmp_path / 'relay'}"
    engines = {f"{MEMBER} dp{r}": Listened(MEMBER, rank=r) for r in (0, 1)}
    index, metrics = KvIndex(max_blocks=10_000), Metrics()
    reader = EventListener("127.0.0.1", 0, index, metrics, context=ctx, listen=False, relay=relay)
    await reader.set_engines(engines)
    try:
        async with listening(ctx, engines, relay=relay) as (listener, _, _):
            assert reader.bound == {}
            pub = Publisher(ctx, listener.bound[1], "kv@127.0.0.7@m")
            hostile = Publisher(ctx, listener.bound[1], "kv@10.6.6.6@m")
            try:
                await hostile.send(batch(chain(500, TOKENS[:8])))
                await until_indexed(pub, index, f"{MEMBER} dp1")  # rank 1, in the reader
                assert index.engines() == sorted(engines)  # no engine of the attacker's
            finally:
                pub.close()
                hostile.close()
    finally:
        await reader.stop()


async def test_watchers_hand_connecting_engines_to_the_listener_and_drop_those_that_leave(
    ctx: Any,
) -> None:
    index, metrics = KvIndex(max_blocks=10_000), Metrics()
    listener = EventListener("127.0.0.1", 0, index, metrics, context=ctx)
    watchers = KvEventWatchers(index, metrics, context=ctx, listener=listener)
    other = "127.0.0.8:8000"
    try:
        await watchers.set_sources(
            {MEMBER: EventSource("", address=MEMBER), other: EventSource("", address=other)}
        )
        assert sorted(index.engines()) == sorted([MEMBER, other])
        pub = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m")
        try:
            await until_indexed(pub, index, MEMBER)
            await watchers.set_sources({other: EventSource("", address=other)})  # it left
            assert index.engines() == [other] and held(index) == {}
            await pub.send(batch(chain(1, TOKENS[:16])))
            await until_true(
                lambda: count(metrics.kv_event_unattributed, "unknown_topic") >= 1, "dropped"
            )
            assert index.engines() == [other]
        finally:
            pub.close()
    finally:
        await watchers.stop()
    assert listener.bound == {}


async def test_a_receiver_that_fails_is_restarted_and_counted(
    ctx: Any, monkeypatch: Any, caplog: Any
) -> None:
    async with listening(ctx, {MEMBER: Listened(MEMBER)}) as (listener, index, metrics):
        attribute = listener._engine_of
        failures = iter([True])

        def failing_once(frames: list[bytes], rank: int) -> str | None:
            if next(failures, False):
                raise RuntimeError("a bug")
            return attribute(frames, rank)

        monkeypatch.setattr(listener, "_engine_of", failing_once)
        pub = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m")
        try:
            await until_indexed(pub, index, MEMBER)
        finally:
            pub.close()
        assert count(metrics.kv_event_subscriber_restarts, "listener rank 0") == 1
        assert "the listener's rank 0 receiver failed (RuntimeError: a bug)" in caplog.text


async def test_a_relay_that_cannot_be_bound_is_one_line_and_the_listener_still_indexes(
    ctx: Any, tmp_path: Any, caplog: Any
) -> None:
    relay = f"ipc://{tmp_path / 'gone' / 'relay'}"
    async with listening(ctx, {MEMBER: Listened(MEMBER)}, relay=relay) as (listener, index, _):
        assert "cannot relay to the other ext_proc processes" in caplog.text
        pub = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m")
        try:
            await until_indexed(pub, index, MEMBER)
        finally:
            pub.close()


async def test_a_batch_that_comes_while_engines_sharing_a_host_leave_is_dropped_not_a_failure(
    ctx: Any, monkeypatch: Any
) -> None:
    """`set_engines` stops the leaving engines one by one: a batch for their host that comes
    meanwhile names one already gone: it is attributed among those left, and the receiver
    does not fail (a KeyError restarted it, its queued batches lost)."""
    import extproc.kvcache.listener as listener_module

    engines = {
        "127.0.0.7:8000": Listened("127.0.0.7:8000", "a"),
        "127.0.0.7:8001": Listened("127.0.0.7:8001", "b"),
    }
    async with listening(ctx, engines) as (listener, _, _):
        seen: list[str | None] = []
        stop = listener_module.cancel_and_wait

        async def stop_then_receive(tasks: Any) -> None:
            await stop(tasks)
            frames = [b"kv@127.0.0.7@b", (0).to_bytes(8, "big"), batch()]
            seen.append(listener._engine_of(frames, 0))  # as `_receive` would, meanwhile

        monkeypatch.setattr(listener_module, "cancel_and_wait", stop_then_receive)
        try:
            await listener.set_engines({})
        finally:
            monkeypatch.undo()
        # after "a" stopped, then after "b" stopped with "a" already gone: "b" both times
        assert seen == ["127.0.0.7:8001", "127.0.0.7:8001"]


def test_with_port_0_each_rank_listens_on_rank_0s_port_plus_its_rank() -> None:
    listener = EventListener("127.0.0.1", 0, KvIndex(max_blocks=10), Metrics())
    listener.bound[0] = "tcp://127.0.0.1:40000"  # the port the system gave rank 0
    assert [listener._rank_port(rank) for rank in (1, 3)] == [40001, 40003]
    fixed = EventListener("127.0.0.1", 5557, KvIndex(max_blocks=10), Metrics())
    assert fixed._rank_port(2) == 5559


async def test_a_relay_that_cannot_be_bound_is_said_once_whatever_the_ranks(
    ctx: Any, tmp_path: Any, caplog: Any
) -> None:
    relay = f"ipc://{tmp_path / 'gone' / 'relay'}"
    engines = {f"{MEMBER} dp{r}": Listened(MEMBER, rank=r) for r in (0, 1)}
    async with listening(ctx, engines, relay=relay):
        said = [r.getMessage() for r in caplog.records if "relay" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith(
        f"KV events: cannot relay to the other ext_proc processes on {relay} (No such file"
    )  # with ZMQ's reason
    assert said[0].endswith("); they route those engines without their events")


async def test_a_port_taken_is_said_once_in_full_and_not_tried_again(ctx: Any, caplog: Any) -> None:
    port = two_free_ports()
    holder = ctx.socket(zmq.PUB)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind(f"tcp://127.0.0.1:{port}")  # another process holds the engines' port
    listener = EventListener("127.0.0.1", port, KvIndex(max_blocks=10), Metrics(), context=ctx)
    try:
        with caplog.at_level(logging.INFO, "extproc"):
            await listener.set_engines({MEMBER: Listened(MEMBER)})
            await listener.set_engines({MEMBER: Listened(MEMBER), "x": Listened("10.0.0.8:1")})
        said = [r.getMessage() for r in caplog.records if "cannot listen" in r.getMessage()]
        assert len(said) == 1 and 0 not in listener.bound
        assert said[0].startswith(
            f"KV events: cannot listen on tcp://127.0.0.1:{port} for data-parallel rank 0 "
            "(Address already in use"  # ZMQ's reason
        )
        assert said[0].endswith(
            "); engines that connect there are not indexed. Free the port or change "
            "kv_listener.port"
        )
    finally:
        await listener.stop()
        holder.close(linger=0)


async def test_the_listener_says_where_it_listens_with_port_0_and_on_ipv6(
    ctx: Any, caplog: Any
) -> None:
    for host in ("127.0.0.1", "::1"):
        listener = EventListener(host, 0, KvIndex(max_blocks=10), Metrics(), context=ctx)
        try:
            with caplog.at_level(logging.INFO, "extproc"):
                await listener.set_engines({MEMBER: Listened(MEMBER)})
            shown = host if host == "127.0.0.1" else f"[{host}]"
            assert listener.bound[0].startswith(f"tcp://{shown}:")
            assert int(listener.bound[0].rpartition(":")[2]) >= 1024  # the system's choice
            assert (
                f"KV events: listening on {listener.bound[0]} for engines that connect "
                "(data-parallel rank 0); only the engines may reach it"
            ) in caplog.text
        finally:
            await listener.stop()


async def test_a_member_of_the_top_level_pools_takes_any_model_on_a_host_it_shares(
    ctx: Any,
) -> None:
    """Engines sharing an IP are told apart by the topic's model: one of the top-level pools
    (model "") serves whatever model its topic names."""
    engines = {
        "127.0.0.7:8000": Listened("127.0.0.7:8000"),
        "127.0.0.7:8001": Listened("127.0.0.7:8001", "b"),
    }
    async with listening(ctx, engines) as (listener, _, _):
        frames = [b"kv@127.0.0.7@a", (0).to_bytes(8, "big"), batch()]
        assert listener._engine_of(frames, 0) == "127.0.0.7:8000"


def test_a_sender_is_the_member_only_by_the_same_ip() -> None:
    assert _same_ip("127.0.0.7", MEMBER) and not _same_ip("127.0.0.8", MEMBER)
    # an IPv4 engine seen on an IPv6 socket, and an IPv6 one
    assert _same_ip("::ffff:127.0.0.7", MEMBER) and not _same_ip("::ffff:127.0.0.8", MEMBER)
    assert _same_ip("fd00::7", "[fd00::7]:8000") and not _same_ip("fd00::8", "[fd00::7]:8000")
    # a member named by host name, or a peer ZMQ could not say: never taken as the sender
    assert not _same_ip("127.0.0.7", "engine-0.vllm:8000") and not _same_ip("", MEMBER)


async def test_a_host_that_cannot_be_bound_refuses_every_rank_with_a_line_each(
    ctx: Any, caplog: Any
) -> None:
    # kv_listener.host names no local address: rank 0 has no port, so neither has rank 1
    listener = EventListener("fd00::7", 0, KvIndex(max_blocks=10), Metrics(), context=ctx)
    try:
        await listener.set_engines({f"{MEMBER} dp{r}": Listened(MEMBER, rank=r) for r in (0, 1)})
        said = [r.getMessage() for r in caplog.records if "cannot listen" in r.getMessage()]
        assert listener.bound == {} and len(said) == 2
        assert said[1].startswith("KV events: cannot listen on tcp://[fd00::7]:")
        assert " for data-parallel rank 1 (" in said[1]
    finally:
        await listener.stop()


async def test_a_message_no_engine_is_found_for_is_counted_by_why(ctx: Any) -> None:
    engines = {  # two members on one IP, both of the top-level pools: the model cannot say
        "127.0.0.7:8000": Listened("127.0.0.7:8000"),
        "127.0.0.7:8001": Listened("127.0.0.7:8001"),
    }
    async with listening(ctx, engines) as (listener, _, metrics):
        seq = (0).to_bytes(8, "big")
        for frames, why in (
            ([b"kv@127.0.0.7@m", seq], "malformed"),
            ([b"not-a-topic", seq, batch()], "unknown_topic"),
            ([b"kv@10.6.6.6@m", seq, batch()], "unknown_topic"),
            ([b"kv@127.0.0.7@m", seq, batch()], "ambiguous_topic"),
        ):
            before = count(metrics.kv_event_unattributed, why)
            assert listener._engine_of(frames, 0) is None
            assert count(metrics.kv_event_unattributed, why) == before + 1, why
        assert listener._engine_of([b"kv@127.0.0.7:8001@m", seq, batch()], 0) == "127.0.0.7:8001"


async def test_a_message_of_one_frame_is_dropped_and_the_receiver_goes_straight_on(
    ctx: Any,
) -> None:
    limits = SubscriberLimits(restart_backoff_s=60, max_restart_backoff_s=60)
    async with listening(ctx, {MEMBER: Listened(MEMBER)}, limits=limits) as (
        listener,
        index,
        metrics,
    ):
        pub = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m")
        try:

            async def counted() -> bool:  # sent until one arrives (the slow joiner)
                await pub.raw([b"kv@127.0.0.7@m"])
                return count(metrics.kv_event_unattributed, "malformed") >= 1

            await until(counted, "the one-frame message counted")
            await until_indexed(pub, index, MEMBER)  # at once: no pause after a drop
            assert count(metrics.kv_event_subscriber_restarts, "listener rank 0") == 0
        finally:
            pub.close()


async def test_a_full_engine_queue_drops_the_batch_and_the_receiver_goes_on(
    ctx: Any, monkeypatch: Any
) -> None:
    limits = SubscriberLimits(receive_hwm=1)
    listener = EventListener(
        "127.0.0.1", 0, KvIndex(10_000), Metrics(), limits=limits, context=ctx, check_sender=False
    )
    await listener.set_engines({MEMBER: Listened(MEMBER)})

    async def stuck(frames: list[bytes]) -> None:  # the engine's stream applies nothing
        await asyncio.Event().wait()

    monkeypatch.setattr(listener._fed[MEMBER].stream, "on_message", stuck)
    four = [[b"kv@127.0.0.7@m", seq.to_bytes(8, "big"), batch()] for seq in range(4)]
    flood = Flood(four)
    receiving = asyncio.create_task(listener._receive(flood, 0))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(flood.idle.wait(), 10)  # past the queue's one place, and on
        assert not receiving.done()
    finally:
        await cancel_and_wait([receiving])
        await listener.stop()


async def test_a_receiver_that_keeps_failing_backs_off_doubling_and_says_which(
    caplog: Any,
) -> None:
    metrics = Metrics()
    limits = SubscriberLimits(restart_backoff_s=0.01, max_restart_backoff_s=0.03)
    listener = EventListener("127.0.0.1", 0, KvIndex(max_blocks=10), metrics, limits=limits)

    class Broken:  # a socket whose every poll fails
        async def poll(self, **_: int) -> int:
            raise RuntimeError("a bug")

    receiving = asyncio.create_task(listener._receiving(Broken(), None))  # type: ignore[arg-type]
    try:
        restarts = metrics.kv_event_subscriber_restarts
        await until_true(lambda: count(restarts, "listener relay") >= 4, "four restarts")
    finally:
        await cancel_and_wait([receiving])
    said = [r.getMessage() for r in caplog.records if "receiver failed" in r.getMessage()]
    failed = "KV events: the listener's relay receiver failed (RuntimeError: a bug)"
    assert said[:4] == [f"{failed}; restarting in {s} s" for s in ("0.01", "0.02", "0.03", "0.03")]


async def test_an_idle_receiver_keeps_polling_without_backing_off(ctx: Any) -> None:
    # it wakes every poll_s to poll again: an idle spell is no failure to back off from
    limits = SubscriberLimits(poll_s=0.001, restart_backoff_s=60, max_restart_backoff_s=60)
    index = KvIndex(max_blocks=10_000)
    listener = EventListener("127.0.0.1", 0, index, Metrics(), limits=limits, context=ctx)
    await listener.set_engines({MEMBER: Listened(MEMBER)})
    pub = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m")
    try:
        await until_indexed(pub, index, MEMBER)
    finally:
        pub.close()
        await listener.stop()


async def test_a_flood_of_batches_is_received_without_pausing(ctx: Any) -> None:
    listener = EventListener(
        "127.0.0.1", 0, KvIndex(10_000), Metrics(), context=ctx, check_sender=False
    )
    await listener.set_engines({MEMBER: Listened(MEMBER)})
    topic = b"kv@127.0.0.7@m"
    flood = Flood([[topic, seq.to_bytes(8, "big"), batch()] for seq in range(100)])
    receiving = asyncio.create_task(listener._receive(flood, 0))  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(flood.idle.wait(), 10)  # a loop turn each, no more
    finally:
        await cancel_and_wait([receiving])
        await listener.stop()


async def test_each_engines_stream_has_its_replay_socket_and_the_listeners_limits(
    ctx: Any,
) -> None:
    metrics = Metrics()
    limits = SubscriberLimits(max_batch_bytes=1024)
    listener = EventListener(
        "127.0.0.1", 0, KvIndex(10_000), metrics, limits=limits, context=ctx, check_sender=False
    )
    replay = "tcp://127.0.0.7:1"
    await listener.set_engines({MEMBER: Listened(MEMBER, replay_endpoint=replay)})
    assert listener._fed[MEMBER].stream.replay_endpoint == replay
    big = batch(*(chain(10 + 2 * i, [i + t for t in range(8)]) for i in range(100)))
    flood = Flood([[b"kv@127.0.0.7@m", (0).to_bytes(8, "big"), big]])
    receiving = asyncio.create_task(listener._receive(flood, 0))  # type: ignore[arg-type]
    try:
        await until_true(
            lambda: count(metrics.kv_event_batches, MEMBER, "oversized") == 1,
            "the batch over the listener's bound dropped",
        )
    finally:
        await cancel_and_wait([receiving])
        await listener.stop()


async def test_an_engine_given_again_keeps_its_stream_and_its_entries(ctx: Any) -> None:
    index = KvIndex(10_000)
    listener = EventListener("127.0.0.1", 0, index, Metrics(), context=ctx, check_sender=False)
    await listener.set_engines({MEMBER: Listened(MEMBER)})
    flood = Flood([[b"kv@127.0.0.7@m", (0).to_bytes(8, "big"), batch(chain(1, TOKENS))]])
    receiving = asyncio.create_task(listener._receive(flood, 0))  # type: ignore[arg-type]
    try:
        await until_true(lambda: held(index) == {MEMBER: 8}, "the batch indexed")
        stream = listener._fed[MEMBER].stream
        # another engine joins: the one already followed is not started over (that clears it)
        await listener.set_engines({MEMBER: Listened(MEMBER), "x": Listened("127.0.0.8:1")})
        assert listener._fed[MEMBER].stream is stream
        assert held(index) == {MEMBER: 8}
    finally:
        await cancel_and_wait([receiving])
        await listener.stop()


async def test_an_engines_stream_that_fails_drops_its_entries_is_counted_and_goes_on(
    ctx: Any, monkeypatch: Any
) -> None:
    index, metrics = KvIndex(10_000), Metrics()
    limits = SubscriberLimits(restart_backoff_s=0.01)
    listener = EventListener(
        "127.0.0.1", 0, index, metrics, limits=limits, context=ctx, check_sender=False
    )
    await listener.set_engines({MEMBER: Listened(MEMBER)})
    stream = listener._fed[MEMBER].stream
    apply, calls = stream.on_message, 0

    async def failing_the_second(frames: list[bytes]) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("a bug")
        await apply(frames)

    monkeypatch.setattr(stream, "on_message", failing_the_second)
    other = [t + 1000 for t in TOKENS]
    topic = b"kv@127.0.0.7@m"
    flood = Flood(
        [
            [topic, (0).to_bytes(8, "big"), batch(chain(1, TOKENS))],
            [topic, (1).to_bytes(8, "big"), batch()],  # the stream fails on this one
            [topic, (2).to_bytes(8, "big"), batch(chain(500, other))],
        ]
    )
    receiving = asyncio.create_task(listener._receive(flood, 0))  # type: ignore[arg-type]
    try:
        await until_true(lambda: held(index, other) == {MEMBER: 8}, "the batch after indexed")
        assert count(metrics.kv_event_subscriber_restarts, MEMBER) == 1
        assert held(index) == {}  # what it held before the failure is unknown: dropped
    finally:
        await cancel_and_wait([receiving])
        await listener.stop()


async def test_a_stopped_listener_given_engines_again_listens_and_relays_again(
    ctx: Any, tmp_path: Any
) -> None:
    relay = f"ipc://{tmp_path / 'relay'}"
    engines = {MEMBER: Listened(MEMBER)}
    index = KvIndex(max_blocks=10_000)
    reader = EventListener("127.0.0.1", 0, index, Metrics(), context=ctx, listen=False, relay=relay)
    listener = EventListener("127.0.0.1", 0, KvIndex(10_000), Metrics(), context=ctx, relay=relay)
    await reader.set_engines(engines)
    try:
        await listener.set_engines(engines)
        await listener.stop()
        assert listener.bound == {}
        await listener.set_engines(engines)
        pub = Publisher(ctx, listener.bound[0], "kv@127.0.0.7@m")
        try:
            await until_indexed(pub, index, MEMBER)  # in the reader: relayed
        finally:
            pub.close()
    finally:
        await listener.stop()
        await reader.stop()


async def test_the_listener_binds_on_the_context_given_or_else_on_zmqs_shared_one(
    ctx: Any,
) -> None:
    for given, expected in ((ctx, ctx), (None, zmq.asyncio.Context.instance())):
        listener = EventListener("127.0.0.1", 0, KvIndex(10), Metrics(), context=given)
        try:
            await listener.set_engines({MEMBER: Listened(MEMBER)})
            assert listener._sockets[0][0].context is expected
        finally:
            await listener.stop()
