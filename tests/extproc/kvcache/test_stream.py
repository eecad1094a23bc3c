"""One engine's stream, driven message by message: what a replay socket answers decides which
batches are applied and how the replay is counted (filled, short, failed), whatever order or
shape its answer has; and the budget's pacing, on a clock of the test's own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from extproc.kvcache import stream as stream_module
from extproc.kvcache.index import KvIndex
from extproc.kvcache.stream import Budget, EngineStream, SubscriberLimits
from extproc.metrics import Metrics
from extproc.stopping import cancel_and_wait
from tests.extproc.kvcache.kv_events_helpers import END, batch, chain

TOKENS = list(range(1, 33))
A, B, C = (batch(chain(10 * n, TOKENS[4 * n : 4 * n + 4])) for n in range(3))  # one block each


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def kept(n: int, payload: bytes, topic: bytes = b"") -> list[bytes]:
    """A replayed batch as vLLM's ROUTER sends it (after the DEALER's empty frame)."""
    return [b"", topic, seq(n), payload]


class ScriptedReplay:
    """A ROUTER on 127.0.0.1 that answers each replay request with the frames it is given."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.answer: list[list[bytes]] | None = []  # None: no answer at all
        self.asked: list[int] = []
        self.delimiters: list[bytes] = []
        self._server = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            client, delimiter, start = await self.router.recv_multipart()
            self.delimiters.append(delimiter)
            self.asked.append(int.from_bytes(start, "big"))
            for frames in self.answer or []:
                await self.router.send_multipart([client, *frames])

    async def close(self) -> None:
        await cancel_and_wait([self._server])
        self.router.close(linger=0)


@pytest_asyncio.fixture
async def replay() -> AsyncIterator[ScriptedReplay]:
    ctx = zmq.asyncio.Context()
    scripted = ScriptedReplay(ctx)
    yield scripted
    await scripted.close()
    ctx.destroy(linger=0)  # a failed test's sockets too: term() would wait on them


def make_stream(replay: ScriptedReplay, **limited: Any) -> tuple[EngineStream, KvIndex, Metrics]:
    index, metrics = KvIndex(max_blocks=1000), Metrics()
    limits = SubscriberLimits(**{"replay_timeout_s": 5.0, **limited})  # a broken replay waits
    engine = EngineStream(
        "e", index, metrics, replay_endpoint=replay.endpoint, limits=limits, context=replay.ctx
    )
    engine.start()
    return engine, index, metrics


def count(metric: Any, *labels: str) -> float:
    return float(metric.labels(*labels)._value.get())


def held(index: KvIndex) -> list[int]:
    """Which of A, B and C's blocks the engine holds."""
    return [n for n in range(3) if index.longest_prefix(TOKENS[4 * n : 4 * n + 4])["e"]]


def outcomes(metrics: Metrics) -> dict[str, float]:
    """The replays counted by outcome, and the batches applied from the replay and live."""
    replays = {o: count(metrics.kv_event_replays, "e", o) for o in ("filled", "short", "failed")}
    batches = {o: count(metrics.kv_event_batches, "e", o) for o in ("replayed", "applied")}
    return {k: v for k, v in (replays | batches).items() if v}


END_OF_REPLAY = [b"", b"", END, b""]


async def test_a_joiner_applies_what_the_replay_kept_from_its_oldest_batch_on(
    replay: ScriptedReplay,
) -> None:
    # the engine's buffer starts at 3 (older batches forgotten); a topic names its stream
    replay.answer = [kept(3, A, b"kv"), kept(4, B, b"kv"), kept(5, C, b"kv"), END_OF_REPLAY]
    stream, index, metrics = make_stream(replay)
    await stream.on_message([b"kv", seq(5), C])
    assert replay.asked == [0] and replay.delimiters == [b""]  # vLLM's request: (b"", start)
    assert held(index) == [0, 1, 2]
    assert outcomes(metrics) == {"filled": 1, "replayed": 2, "applied": 1}


async def test_the_replay_goes_through_the_context_given(replay: ScriptedReplay) -> None:
    # an in-process socket is reachable from its own context only
    replay.router.bind("inproc://kv-replay")
    replay.answer = [kept(3, A, b"kv"), kept(4, B, b"kv"), kept(5, C, b"kv"), END_OF_REPLAY]
    index = KvIndex(max_blocks=1000)
    limits = SubscriberLimits(replay_timeout_s=5.0)
    stream = EngineStream(
        "e",
        index,
        Metrics(),
        replay_endpoint="inproc://kv-replay",
        limits=limits,
        context=replay.ctx,
    )
    stream.start()
    await stream.on_message([b"kv", seq(5), C])
    assert held(index) == [0, 1, 2]


async def test_a_joiner_whose_replay_starts_at_the_batch_it_got_applies_that_batch_once(
    replay: ScriptedReplay,
) -> None:
    replay.answer = [kept(5, C), END_OF_REPLAY]
    stream, index, metrics = make_stream(replay)
    await stream.on_message([b"", seq(5), C])
    assert held(index) == [2]
    assert outcomes(metrics) == {"short": 1, "applied": 1}  # nothing older: no reset either
    assert count(metrics.kv_index_resets, "e", "gap") == 0


async def test_a_joiner_whose_replay_stops_short_of_the_batch_it_got_drops_what_it_applied(
    replay: ScriptedReplay,
) -> None:
    replay.answer = [kept(3, A), kept(4, B), END_OF_REPLAY]  # batches 5 and 6 are missing
    stream, index, metrics = make_stream(replay)
    await stream.on_message([b"", seq(7), C])
    assert held(index) == [2]  # A and B dropped: something is missing between them and C
    assert outcomes(metrics) == {"short": 1, "replayed": 2, "applied": 1}
    assert count(metrics.kv_index_resets, "e", "gap") == 1


async def test_a_stream_that_starts_after_batch_0_asks_for_it_and_one_from_0_does_not(
    replay: ScriptedReplay,
) -> None:
    replay.answer = [kept(0, A), END_OF_REPLAY]
    stream, index, metrics = make_stream(replay)
    await stream.on_message([b"", seq(1), B])
    assert replay.asked == [0] and held(index) == [0, 1]
    stream.start()  # rejoined: this time from the engine's first batch on
    await stream.on_message([b"", seq(0), C])
    assert replay.asked == [0] and held(index) == [2]
    assert outcomes(metrics) == {"filled": 1, "replayed": 1, "applied": 2}


async def test_a_sequence_that_goes_back_is_a_restarted_engine(
    replay: ScriptedReplay, caplog: pytest.LogCaptureFixture
) -> None:
    stream, index, metrics = make_stream(replay)
    caplog.set_level("INFO", logger="extproc")
    await stream.on_message([b"", seq(0), A])
    await stream.on_message([b"", seq(1), B])
    await stream.on_message([b"", seq(0), C])  # a new engine process numbers from 0 again
    assert held(index) == [2] and count(metrics.kv_index_resets, "e", "restart") == 1
    assert "KV events of e: sequence went back (0 after 1): engine restarted" in caplog.messages
    assert replay.asked == []


@pytest.mark.parametrize(
    ("gap", "outcome"), [(2, "short"), (3, "skipped")], ids=["at the bound", "past it"]
)
async def test_a_gap_longer_than_the_replay_keeps_is_not_asked_for(
    replay: ScriptedReplay, gap: int, outcome: str
) -> None:
    stream, index, metrics = make_stream(replay, max_replay_batches=2)
    replay.answer = [END_OF_REPLAY]
    await stream.on_message([b"", seq(100), A])  # joined late: 2 batches asked for, from 98
    await stream.on_message([b"", seq(101 + gap), C])
    assert replay.asked == ([98, 101] if outcome == "short" else [98])
    assert count(metrics.kv_event_replays, "e", outcome) == 1 + (outcome == "short")
    assert count(metrics.kv_index_resets, "e", "gap") == 1 and held(index) == [2]


async def test_a_replay_socket_that_does_not_answer_fails_the_replay_and_says_so(
    replay: ScriptedReplay, caplog: pytest.LogCaptureFixture
) -> None:
    stream, index, metrics = make_stream(replay, replay_timeout_s=0.2)
    await stream.on_message([b"", seq(0), A])
    replay.answer = None
    await stream.on_message([b"", seq(2), C])
    assert outcomes(metrics) == {"failed": 1, "applied": 2} and held(index) == [2]
    assert f"KV events of e: no replay from {replay.endpoint} within 0.2 s" in caplog.messages


@pytest.mark.parametrize(
    "answer",
    [[kept(2, B), END_OF_REPLAY], [END_OF_REPLAY]],
    ids=["from a later batch on", "nothing kept"],
)
async def test_a_gap_the_replay_cannot_fill_from_its_start_is_short_and_resets(
    replay: ScriptedReplay, answer: list[list[bytes]]
) -> None:
    stream, index, metrics = make_stream(replay)
    await stream.on_message([b"", seq(0), A])
    replay.answer = answer  # batch 1 is gone from the engine's buffer
    await stream.on_message([b"", seq(3), C])
    assert replay.asked == [1]
    assert held(index) == [2]  # A dropped with the gap, B not applied past it
    assert outcomes(metrics) == {"short": 1, "applied": 2}
    assert count(metrics.kv_index_resets, "e", "gap") == 1


async def test_batches_older_than_the_gap_in_a_replay_are_passed_over(
    replay: ScriptedReplay,
) -> None:
    stream, index, metrics = make_stream(replay)
    await stream.on_message([b"kv", seq(0), A])
    # a replay answering from further back: batch 0 again (a clear, were it applied), then 1, 2
    replay.answer = [
        kept(0, batch({"type": "AllBlocksCleared"}), b"kv"),
        kept(1, B, b"kv"),
        kept(2, C, b"kv"),
        END_OF_REPLAY,
    ]
    await stream.on_message([b"kv", seq(3), batch()])
    assert held(index) == [0, 1, 2]
    assert outcomes(metrics) == {"filled": 1, "replayed": 2, "applied": 2}


@pytest.mark.parametrize(
    "frames",
    [[b"x", b"", seq(1), B], [b"", b"", seq(1)], [b"", b"", b"\x01", B]],
    ids=["delimiter not empty", "three frames", "a 1-byte sequence number"],
)
async def test_a_replay_answer_of_the_wrong_shape_fails_the_replay(
    replay: ScriptedReplay, frames: list[bytes]
) -> None:
    stream, index, metrics = make_stream(replay)
    await stream.on_message([b"", seq(0), A])
    replay.answer = [frames, END_OF_REPLAY]
    await stream.on_message([b"", seq(2), C])
    assert held(index) == [2]
    assert outcomes(metrics) == {"failed": 1, "applied": 2}
    assert count(metrics.kv_index_resets, "e", "gap") == 1


class Clock:
    """time.monotonic and asyncio.sleep for the budget: a sleep moves the clock on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The stream module's monotonic time and asyncio.sleep, both this test's Clock."""
    made = Clock()
    monkeypatch.setattr(stream_module, "time", SimpleNamespace(monotonic=made.monotonic))
    monkeypatch.setattr(stream_module, "asyncio", SimpleNamespace(sleep=made.sleep))
    return made


async def test_the_budget_sleeps_out_the_rest_of_its_second_and_starts_the_next_afresh(
    clock: Clock,
) -> None:
    budget = Budget(batches=2, bytes_=100, share=0.5)
    await budget.spend(10)
    clock.now += 0.25
    await budget.spend(10)
    await budget.spend(10)  # a third batch in the second: the rest of it is slept out
    assert clock.sleeps == [0, 0, 0.75]
    await budget.busy(0.6)  # over its share of the loop: the next second is slept out
    await budget.spend(50)  # and the one after starts with nothing spent
    await budget.spend(50)
    assert clock.sleeps[3:] == [1.0, 0, 0]


async def test_the_budget_sleeps_out_the_second_once_the_loop_time_summed_is_over_its_share(
    clock: Clock,
) -> None:
    budget = Budget(batches=10, bytes_=1000, share=0.5)
    await budget.busy(0.25)
    await budget.busy(0.25)  # half the second: its share, not over it
    assert clock.sleeps == [0, 0]
    await budget.busy(0.125)
    assert clock.sleeps == [0, 0, 1.0]


async def test_a_failing_feed_is_restarted_after_a_backoff_doubled_until_it_works(
    replay: ScriptedReplay, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stream, index, metrics = make_stream(replay)
    clock = Clock()
    monkeypatch.setattr(stream_module, "asyncio", SimpleNamespace(sleep=clock.sleep))
    runs = 0

    async def run() -> None:
        nonlocal runs
        runs += 1
        if runs == 5:  # the fifth run applied a batch before it failed: it worked a while
            await stream.on_message([b"", seq(0), A])
        if runs == 7:
            raise asyncio.CancelledError  # the owner cancels
        raise RuntimeError("boom")

    limits = SubscriberLimits(restart_backoff_s=0.5, max_restart_backoff_s=2.0)
    with pytest.raises(asyncio.CancelledError):
        await stream_module.supervised(stream, run, metrics, limits)
    backoffs = [s for s in clock.sleeps if s]  # (the budget's yields sleep 0)
    assert backoffs == [0.5, 1.0, 2.0, 2.0, 0.5, 1.0]
    assert count(metrics.kv_event_subscriber_restarts, "e") == 6 and held(index) == []
    assert (
        caplog.messages.count(
            "KV events of e: subscriber failed (RuntimeError: boom); its index entries dropped, "
            "restarting in 0.5 s"
        )
        == 2
    )


async def test_a_batch_of_many_slices_is_applied_whole(replay: ScriptedReplay) -> None:
    stream, index, metrics = make_stream(replay, slice_blocks=1)
    three = batch(*(chain(10 * n, TOKENS[4 * n : 4 * n + 4]) for n in range(3)))
    await stream.on_message([b"", seq(0), three])  # applied one block at a time
    assert held(index) == [0, 1, 2] and outcomes(metrics) == {"applied": 1}


async def test_a_batch_at_the_size_bound_is_applied_and_one_byte_over_is_dropped(
    replay: ScriptedReplay, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="extproc")
    stream, index, metrics = make_stream(replay, max_batch_bytes=len(A))
    await stream.on_message([b"", seq(0), A])
    await stream.on_message([b"", seq(1), B + b" "])
    assert held(index) == [] and count(metrics.kv_index_resets, "e", "oversized") == 1
    assert f"KV events of e: batch 1 of {len(B) + 1} bytes dropped" in caplog.messages
    await stream.on_message([b"", seq(2), b"\xc1"])  # not msgpack
    assert "KV events of e: batch 2 skipped: msgpack" in caplog.messages
    assert outcomes(metrics) == {"applied": 1}


async def test_the_lag_of_a_batch_is_observed_from_its_timestamp_if_it_has_one(
    replay: ScriptedReplay, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream, _, metrics = make_stream(replay)
    now = SimpleNamespace(
        time=lambda: 1000.5, perf_counter=time.perf_counter, monotonic=time.monotonic
    )
    monkeypatch.setattr(stream_module, "time", now)
    await stream.on_message([b"", seq(0), batch(ts=1000.0)])
    await stream.on_message([b"", seq(1), batch(ts=0.0)])  # none: no sample
    lag = metrics.kv_event_lag_seconds
    assert (lag._sum.get(), count_samples(lag)) == (0.5, 1)


def count_samples(histogram: Any) -> float:
    return float(sum(bucket.get() for bucket in histogram._buckets))


async def test_the_budget_counts_batches_and_bytes_per_second_and_renews_on_the_second(
    clock: Clock,
) -> None:
    budget = Budget(batches=3, bytes_=100, share=1.0)
    for size in (60, 40):  # at the byte limit: not over it
        await budget.spend(size)
    await budget.spend(1)  # over it: the second is slept out, this batch the next's first
    for _ in range(3):  # the third of the new second is over: slept out again
        await budget.spend(1)
    assert clock.sleeps == [0, 0, 1.0, 0, 0, 1.0]
    await budget.spend(1)
    await budget.spend(1)  # three in this second
    clock.now += 1.0  # exactly a second after it began: a new one, nothing spent
    await budget.spend(1)
    assert clock.sleeps[6:] == [0, 0, 0]
