"""One engine's KV events, subscribed to over ZMQ and applied to the index in sequence.

vLLM's publisher sends `(topic, 8-byte big-endian sequence number, msgpack batch)` on a PUB
socket and keeps its last batches for replay on a ROUTER socket: a DEALER sends `(b"", start)`
and gets `(b"", topic, seq, batch)` for every kept batch from `start` on, then `(b"", b"", -1,
b"")`. A gap in the sequence is filled from there; where it cannot be (no replay socket, the
batches gone, no answer in time) the engine's entries are dropped, since a lost BlockRemoved
would leave the index claiming blocks the engine no longer has. A sequence that goes back is a
restarted engine: its entries go too.

A broken or hostile publisher cannot grow memory or burn CPU: ZMQ holds at most `receive_hwm`
messages of at most `max_message_bytes` each (it drops the rest, which shows up as a gap), the
decoder bounds every array, and a per-second budget of batches and bytes paces the work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from extproc.kvcache.events import AllCleared, MalformedBatch, decode_batch
from extproc.kvcache.index import KvIndex
from extproc.metrics import Metrics
from extproc.stopping import cancel_and_wait

__all__ = ["EngineEvents", "SubscriberLimits"]

log = logging.getLogger("extproc")

_END_OF_REPLAY = -1
_SEQ_BYTES = 8


@dataclass(frozen=True, slots=True)
class SubscriberLimits:
    receive_hwm: int = 1000  # messages ZMQ queues before dropping
    max_message_bytes: int = 16 << 20  # ZMQ disconnects a peer that sends a larger frame
    max_replay_batches: int = 10_000  # vLLM's default replay buffer; a longer gap resets
    replay_timeout_s: float = 2.0
    poll_s: float = 1.0
    batches_per_s: int = 5_000  # an engine sends one batch per scheduler step
    bytes_per_s: int = 64 << 20


class EngineEvents:
    """Subscribes to one engine's KV events and keeps its entries in `index` current."""

    def __init__(
        self,
        engine: str,
        endpoint: str,
        index: KvIndex,
        metrics: Metrics,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        limits: SubscriberLimits | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._index = index
        self._metrics = metrics
        self._limits = limits or SubscriberLimits()
        self._context = context or zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None
        self._next_seq: int | None = None  # None until the first batch
        self._budget = _Budget(self._limits.batches_per_s, self._limits.bytes_per_s)
        self.applied = asyncio.Event()  # set after each applied batch (tests and start-up wait)

    def start(self) -> None:
        if self._task is None:
            self._index.clear_engine(self.engine)  # what it held before this start is unknown
            self._index.add_engine(self.engine)
            self._task = asyncio.create_task(self._run(), name=f"kv-events {self.engine}")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def _run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.endpoint)
        try:
            while True:
                if await sub.poll(timeout=int(self._limits.poll_s * 1000)):
                    await self.on_message(await sub.recv_multipart())
        except Exception:
            log.exception(
                "KV events of %s: subscriber failed; its index entries dropped", self.engine
            )
            self._index.clear_engine(self.engine)
            raise
        finally:
            sub.close(linger=0)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.RCVHWM, self._limits.receive_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

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
        self._apply(seq, frames[2], "applied")

    def _apply(self, seq: int, payload: bytes, outcome: str) -> None:
        self._next_seq = seq + 1
        try:
            batch = decode_batch(payload)
        except MalformedBatch as exc:  # what it said is lost, a BlockRemoved perhaps: as a gap
            self._metrics.kv_event_batches.labels(self.engine, "malformed").inc()
            log.debug("KV events of %s: batch %d skipped: %s", self.engine, seq, exc.reason)
            self._reset("malformed")
            return
        if any(isinstance(event, AllCleared) for event in batch.events):
            self._metrics.kv_index_resets.labels(self.engine, "cleared").inc()
        self._index.apply(self.engine, batch.events)
        self._metrics.kv_event_batches.labels(self.engine, outcome).inc()
        if batch.ts > 0:
            self._metrics.kv_event_lag_seconds.observe(max(0.0, time.time() - batch.ts))
        self._metrics.kv_index_blocks.set(self._index.blocks)
        self._metrics.kv_index_bytes.set(self._index.bytes_estimate())
        self.applied.set()

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
        dealer = self._socket(zmq.DEALER)
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
            if seq < want:
                continue  # older than asked: not ours to apply
            if seq > want and (exact or want > start):
                return "short"
            await self._budget.spend(len(frames[3]))
            self._apply(seq, frames[3], "replayed")
            want = seq + 1
        return "filled"


class _Budget:
    """Paces one subscriber to `batches` and `bytes_` a second, sleeping out the second."""

    def __init__(self, batches: int, bytes_: int) -> None:
        self._limits = (batches, bytes_)
        self._window_start = 0.0
        self._used = [0, 0]

    async def spend(self, size: int) -> None:
        now = time.monotonic()
        if now - self._window_start >= 1.0:
            self._window_start, self._used = now, [0, 0]
        self._used[0] += 1
        self._used[1] += size
        if self._used[0] > self._limits[0] or self._used[1] > self._limits[1]:
            await asyncio.sleep(max(0.0, self._window_start + 1.0 - now))
            self._window_start, self._used = time.monotonic(), [1, size]
        else:
            await asyncio.sleep(0)  # a flood of batches still lets the request path run
