"""One engine's KV event stream: its batches applied to the index in sequence, however they
arrive (from its own PUB socket that `EngineEvents` subscribes to, or through the socket engines
connect to, `EventListener`), so that sequencing, slicing and pacing have one implementation.

vLLM's publisher sends `(topic, 8-byte big-endian sequence number, msgpack batch)` and keeps its
last batches for replay on a ROUTER socket: a DEALER sends `(b"", start)` and gets `(b"", topic,
seq, batch)` for every kept batch from `start` on, then `(b"", b"", -1, b"")`. A gap in the
sequence is filled from there; where it cannot be (no replay socket, the batches gone, no answer
in time) the engine's entries are dropped, since a lost BlockRemoved would leave the index
claiming blocks the engine no longer has. A sequence that goes back is a restarted engine: its
entries go too. The first batch seen is where the stream starts (what came before is asked of
the replay socket, if any): a connecting publisher's first batches are lost to ZMQ's slow
joiner, and the index converges from there, the engine's entries having been cleared at start.

A broken or hostile publisher cannot burn CPU or hold the event loop: a batch over
`max_batch_bytes` is counted and dropped, as a gap; the decoder bounds every array; a batch is
decoded and applied in slices of `slice_blocks` blocks with the loop yielded to between them;
and a per-second budget of batches, bytes and time on the loop paces the work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from extproc.kvcache.events import AllCleared, KvEvent, MalformedBatch, read_batch
from extproc.kvcache.index import KvIndex
from extproc.kvcache.slices import slices
from extproc.metrics import Metrics

__all__ = ["Budget", "EngineStream", "SubscriberLimits", "supervised", "zmq_socket"]

log = logging.getLogger("extproc")

_END_OF_REPLAY = -1
_SEQ_BYTES = 8


@dataclass(frozen=True, slots=True)
class SubscriberLimits:
    # What ZMQ may queue for one engine, at most 64 x 10 MiB: an engine sends one small batch
    # per step, so 64 is a loop turn's lag and more; past it, a gap (filled by the replay).
    receive_hwm: int = 64
    max_message_bytes: int = 10 << 20  # ZMQ disconnects a peer that sends a larger frame
    # A batch is one scheduler step: 8 MiB is a million tokens stored in one step.
    max_batch_bytes: int = 8 << 20
    slice_blocks: int = 512  # blocks decoded and applied between two yields to the loop
    max_replay_batches: int = 10_000  # vLLM's default replay buffer; a longer gap resets
    replay_timeout_s: float = 2.0
    poll_s: float = 1.0
    batches_per_s: int = 5_000  # an engine sends one batch per scheduler step
    bytes_per_s: int = 64 << 20
    loop_share: float = 0.25  # of each second, the most one engine's events hold the loop
    restart_backoff_s: float = 0.5  # before restarting a failed subscriber; doubled each time
    max_restart_backoff_s: float = 30.0


def zmq_socket(
    context: zmq.asyncio.Context, kind: int, limits: SubscriberLimits, *, ipv6: bool = True
) -> zmq.asyncio.Socket:
    """A socket whose queue and frames are bounded by `limits`. `ipv6`: it may reach IPv6
    addresses (ZMQ's sockets are IPv4 only unless told; an IPv4 one still works; a socket
    binding an IPv4 address leaves it off, or its address reads as IPv4-mapped IPv6)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.RCVHWM, limits.receive_hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, int(ipv6))
    return sock


class EngineStream:
    """One engine's batches, applied to `index` in sequence (`on_message`, one at a time)."""

    def __init__(
        self,
        engine: str,
        index: KvIndex,
        metrics: Metrics,
        *,
        replay_endpoint: str | None = None,
        limits: SubscriberLimits | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.engine = engine
        self.replay_endpoint = replay_endpoint
        self._index = index
        self._metrics = metrics
        self._limits = limits or SubscriberLimits()
        self._context = context or zmq.asyncio.Context.instance()
        self._next_seq: int | None = None  # None until the first batch
        self._budget = Budget(
            self._limits.batches_per_s, self._limits.bytes_per_s, self._limits.loop_share
        )
        self.applied = asyncio.Event()  # set after each applied batch (tests and start-up wait)

    def start(self) -> None:
        """The stream begins (again): what the engine held before is unknown."""
        self._index.clear_engine(self.engine)
        self._index.add_engine(self.engine)
        self._next_seq = None  # rejoin as at the start: ask the replay what is kept
        self.applied.clear()

    def failed(self) -> None:
        """Whatever fed the stream failed: its entries are dropped until it starts again."""
        self._index.clear_engine(self.engine)
        self._next_seq = None
        self._metrics.kv_index_blocks.set(self._index.blocks)
        self.applied.clear()

    async def on_message(self, frames: list[bytes]) -> None:
        """One message from the PUB socket: `(topic, seq, payload)`."""
        if len(frames) != 3 or len(frames[1]) != _SEQ_BYTES:
            self._metrics.kv_event_batches.labels(self.engine, "malformed").inc()
            return
        await self._budget.spend(len(frames[2]))
        seq = int.from_bytes(frames[1], "big")
        expected = self._next_seq
        if expected is None and seq > 0:  # joined late: learn what the engine's buffer still has
            await self._catch_up(max(0, seq - self._limits.max_replay_batches), seq, exact=False)
        elif expected is not None and seq < expected:
            log.info(
                "KV events of %s: sequence went back (%d after %d): engine restarted",
                self.engine,
                seq,
                expected - 1,
            )
            self._reset("restart")
        elif expected is not None and seq > expected:
            self._metrics.kv_event_gaps.labels(self.engine).inc()
            await self._catch_up(expected, seq, exact=True)
        await self._apply(seq, frames[2], "applied")

    async def _apply(self, seq: int, payload: bytes, outcome: str) -> None:
        self._next_seq = seq + 1
        if len(payload) > self._limits.max_batch_bytes:  # what it said is lost: as a gap
            self._metrics.kv_event_batches.labels(self.engine, "oversized").inc()
            log.debug(
                "KV events of %s: batch %d of %d bytes dropped", self.engine, seq, len(payload)
            )
            self._reset("oversized")
            return
        try:
            ts, _, events = read_batch(payload)
            await self._apply_in_slices(events)
        except MalformedBatch as exc:  # what it said is lost, a BlockRemoved perhaps: as a gap
            self._metrics.kv_event_batches.labels(self.engine, "malformed").inc()
            log.debug("KV events of %s: batch %d skipped: %s", self.engine, seq, exc.reason)
            self._reset("malformed")
            return
        self._metrics.kv_event_batches.labels(self.engine, outcome).inc()
        if ts > 0:
            self._metrics.kv_event_lag_seconds.observe(max(0.0, time.time() - ts))
        self._metrics.kv_index_blocks.set(self._index.blocks)
        self._metrics.kv_index_bytes.set(self._index.bytes_estimate())
        self.applied.set()

    async def _apply_in_slices(self, events: Iterable[KvEvent | None]) -> None:
        """Decode and apply a slice, yield to the loop (as long as the budget says), the next.
        Where the engine was reset by another task meanwhile (a restart seen by its metrics, or
        it left the pool), the rest of the batch is dropped: as if the reset came after it."""
        epoch = self._index.epoch(self.engine)
        started = time.perf_counter()
        for piece in slices(events, self._limits.slice_blocks):
            if self._index.epoch(self.engine) != epoch:
                return
            if any(isinstance(event, AllCleared) for event in piece):
                self._metrics.kv_index_resets.labels(self.engine, "cleared").inc()
            self._index.apply(self.engine, piece)
            epoch = self._index.epoch(self.engine)
            await self._budget.busy(time.perf_counter() - started)
            started = time.perf_counter()

    def _reset(self, reason: str) -> None:
        self._index.clear_engine(self.engine)
        self._metrics.kv_index_resets.labels(self.engine, reason).inc()
        self._metrics.kv_index_blocks.set(self._index.blocks)

    async def _catch_up(self, start: int, stop: int, *, exact: bool) -> None:
        """Apply batches `start`..`stop - 1` from the replay socket; reset the engine where
        they cannot all be had (`exact=False`: the first may come later than `start`)."""
        outcome = await self._replay(start, stop, exact=exact)
        self._metrics.kv_event_replays.labels(self.engine, outcome).inc()
        if outcome != "filled":
            if exact or self._next_seq is not None:  # something is missing between known batches
                self._reset("gap")
            self._next_seq = stop

    async def _replay(self, start: int, stop: int, *, exact: bool) -> str:
        if self.replay_endpoint is None or stop - start > self._limits.max_replay_batches:
            return "skipped"
        dealer = zmq_socket(self._context, zmq.DEALER, self._limits)
        try:
            dealer.connect(self.replay_endpoint)
            async with asyncio.timeout(self._limits.replay_timeout_s):
                await dealer.send_multipart([b"", start.to_bytes(_SEQ_BYTES, "big")])
                return await self._receive_replay(dealer, start, stop, exact=exact)
        except TimeoutError:
            log.warning(
                "KV events of %s: no replay from %s within %g s",
                self.engine,
                self.replay_endpoint,
                self._limits.replay_timeout_s,
            )
            return "failed"
        finally:
            dealer.close(linger=0)

    async def _receive_replay(
        self, dealer: zmq.asyncio.Socket, start: int, stop: int, *, exact: bool
    ) -> str:
        want = start
        while want < stop:
            frames = await dealer.recv_multipart()
            if len(frames) != 4 or frames[0] or len(frames[2]) != _SEQ_BYTES:
                return "failed"
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == _END_OF_REPLAY or seq >= stop:
                return "short"
            await self._budget.spend(len(frames[3]))  # yields: a flood of old batches too
            if seq < want:
                continue  # older than asked: not ours to apply
            if seq > want and (exact or want > start):
                return "short"
            await self._apply(seq, frames[3], "replayed")
            want = seq + 1
        return "filled"


async def supervised(
    stream: EngineStream,
    run: Callable[[], Awaitable[None]],
    metrics: Metrics,
    limits: SubscriberLimits,
) -> None:
    """Run `run` (what feeds `stream`); whatever ends it but a cancel, restart it after a
    backoff (doubled while it fails again before applying a batch), the engine's entries
    dropped."""
    backoff = limits.restart_backoff_s
    while True:
        try:
            await run()
        except Exception as exc:  # a bug or a library's surprise: it must not end the events
            worked = stream.applied.is_set()  # it worked for a while: not a failure in a loop
            stream.failed()
            metrics.kv_event_subscriber_restarts.labels(stream.engine).inc()
            if worked:
                backoff = limits.restart_backoff_s
            log.error(
                "KV events of %s: subscriber failed (%s: %.200s); its index entries dropped, "
                "restarting in %g s",
                stream.engine,
                type(exc).__name__,
                exc,
                backoff,
            )
        await asyncio.sleep(backoff)
        backoff = min(2 * backoff, limits.max_restart_backoff_s)


class Budget:
    """Paces one subscriber to `batches` and `bytes_` a second, and to `share` of each second
    spent on the event loop, sleeping out the second where one is spent; yields otherwise."""

    def __init__(self, batches: int, bytes_: int, share: float) -> None:
        self._limits = (batches, bytes_)
        self._busy_limit = share
        self._window_start = 0.0
        self._used = [0, 0]
        self._busy = 0.0

    async def spend(self, size: int) -> None:
        """A batch of `size` bytes is about to be handled."""
        self._renew()
        self._used[0] += 1
        self._used[1] += size
        if self._used[0] > self._limits[0] or self._used[1] > self._limits[1]:
            await self._sleep_out()
            self._used = [1, size]
        else:
            await asyncio.sleep(0)  # a flood of batches still lets the request path run

    async def busy(self, seconds: float) -> None:
        """`seconds` were just spent on the loop: yield, or sleep out the second."""
        self._renew()
        self._busy += seconds
        if self._busy > self._busy_limit:
            await self._sleep_out()
        else:
            await asyncio.sleep(0)

    def _renew(self) -> None:
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            self._window_start, self._used, self._busy = now, [0, 0], 0.0

    async def _sleep_out(self) -> None:
        await asyncio.sleep(max(0.0, self._window_start + 1.0 - time.monotonic()))
        self._window_start, self._used, self._busy = time.monotonic(), [0, 0], 0.0
