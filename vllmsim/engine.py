"""The engine step loop: admit waiting -> batch under the token budget -> sleep -> emit.

One loop per engine. A step "takes" its modelled time through asyncio.sleep, so the
simulation costs little CPU; an idle loop waits on an event. Where vLLM keeps stepping while
requests wait for remote KV, an idle engine here waits for the connector's event and then
takes empty steps (`idle_step_ms`) until the connector has nothing left that a step hands
over or sees, because the connector's events are tied to steps: a receive starts when the
scheduler allocates the request (before its step); `connector.start_step()` hands P's blocks
finished in the previous step to the connector's writer; `connector.end_step()` (vLLM's
get_finished) returns the receives the main thread now sees as done, and those requests
decode from the next step.
Each request keeps a timeline of (event, step, wall time) entries (GET /sim/requests).
A step's tokens reach their requests through the API server's one event loop, which also takes
in every new request (`api_path`): both queue on cost_model.ApiProcess.

Request life cycle (vLLM v1 names):
  WAITING --(blocks allocated)--> RUNNING --(last token)--> FINISHED
  WAITING --(blocks allocated, remote KV)--> WAITING_FOR_REMOTE_KVS --(KV in)--> RUNNING
A remote-prefilled request decodes its first token in the step after its KV arrives.

KV content (kv_content.py): a local prefill fills the prompt blocks; a connector writes
what a transfer brings into the pool before calling `kv_ready`. The first token reads the
prompt blocks: every output token derives from what they hold, and the request's KV label
from where it came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllmsim.config import BLOCK_SIZE, CacheConfig, CostModel
from vllmsim.cost_model import ApiProcess, blocks_for, step_seconds
from vllmsim.kv_cache import BlockPool
from vllmsim.kv_content import (
    LOCAL,
    BlockContent,
    Evidence,
    block_fingerprint,
    context_seed,
    fingerprints,
    num_prompt_blocks,
)
from vllmsim.kv_events import KVEvent
from vllmsim.metrics import Metrics
from vllmsim.prefix_cache import NO_SCOPE, HashScope, block_hashes, extend_hashes
from vllmsim.tokens import output_token

log = logging.getLogger(__name__)


class State(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


class KVMode(enum.Enum):
    LOCAL = "local"  # no connector, or no kv_transfer_params
    PREFILL = "prefill"  # do_remote_decode: P keeps the blocks under a lease
    PULL = "pull"  # D reads P's blocks
    PUSH = "push"  # D registers, P writes
    RECOMPUTE = "recompute"  # D got invalid params and prefills locally


@dataclass
class TokenEvent:
    index: int
    text: str
    final: bool = False  # the request's last token: its FinishEvent follows in the same batch


@dataclass
class FinishEvent:
    finish_reason: str
    kv_transfer_params: dict[str, Any] | None


@dataclass
class ErrorEvent:
    message: str
    status: int = 500
    reset: bool = False  # close the HTTP connection (simulated restart)


Event = TokenEvent | FinishEvent | ErrorEvent


# How a request names KV its own engine computed, by how it met the connector.
_COMPUTED_HERE = {KVMode.LOCAL: "local", KVMode.PREFILL: "prefill"}


@dataclass(eq=False)
class SimRequest:
    internal_id: str
    prompt_ids: list[int]
    max_tokens: int
    mode: KVMode = KVMode.LOCAL
    remote: dict[str, Any] | None = None  # kv_transfer_params as received
    state: State = State.WAITING
    arrival: float = field(default_factory=time.monotonic)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_output: int = 0
    context: bytes = b""  # what the prompt blocks held when decoding started
    kv_label: str | None = None  # local | prefill | recompute | pull | push-parallel | ...
    kv_evidence: dict[str, Any] | None = None  # Evidence.as_dict() of the prompt blocks
    fetch_stage: str | None = None  # waiting_to_start | in_progress | completed_waiting
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    # (event, engine step, time.time()): when the request met each step-aligned event; the
    # P side keeps adding to it after the response has left (the WRITE comes later).
    timeline: list[tuple[str, int, float]] = field(default_factory=list)
    block_size: int = BLOCK_SIZE  # the engine's, set on submit
    block_hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks
    num_cached_blocks: int = 0  # prompt blocks found in this engine's prefix cache
    num_hashed_blocks: int = 0  # prompt blocks entered into the prefix cache so far
    chain: list[bytes] = field(default_factory=list)  # the prompt's KV fingerprints (lazy)
    kv_from_transfer: bool = False  # the prompt's KV (past the cached blocks) came over NIXL
    output_ids: list[int] = field(default_factory=list)  # generated tokens (prefix caching)
    session_id: str | None = None  # the client's, as vLLM reads it; its KV events carry it
    scope: HashScope = NO_SCOPE  # its adapter and cache_salt: its blocks' hashes cover them
    submitted: int = 0  # the engine's count of submissions when it came: its arrival order

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the local prefix cache (they are never computed)."""
        return self.num_cached_blocks * self.block_size

    @property
    def num_external_tokens(self) -> int:
        """Prompt tokens a transfer brought (a remote-prefilled request)."""
        return self.prompt_tokens - self.num_cached_tokens if self.kv_from_transfer else 0

    def note(self, event: str, step: int) -> None:
        self.timeline.append((event, step, time.time()))

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_prompt_blocks(self) -> int:
        return num_prompt_blocks(self.prompt_tokens, self.block_size)

    @property
    def prefill_left(self) -> int:
        return self.prompt_tokens - self.num_computed


class KVConnector(Protocol):
    """What the engine needs from a NIXL connector (nixl/pull.py, nixl/push.py)."""

    def start_recv(self, req: SimRequest) -> None: ...
    def request_finished(self, req: SimRequest) -> dict[str, Any] | None: ...
    def start_step(self) -> None: ...
    def end_step(self) -> set[SimRequest]: ...
    def has_pending_work(self) -> bool: ...
    def abort(self, req: SimRequest) -> None: ...


CATCH_UP_S = 0.002  # how far a step may start in the past, on the model's timeline (_step_start)
# Upper bounds (ms) of the step-lateness buckets: how much later than its cost model a step
# ended (the process got the CPU late, or its event loop was busy with HTTP work).
LATENESS_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, math.inf)


@dataclass
class StepLateness:
    """Steps run so far, their planned time and how late they ended, cumulative (a caller
    takes differences over a run)."""

    steps: int = 0
    planned_s: float = 0.0
    late_s: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENESS_BUCKETS_MS))

    def record(self, planned: float, took: float) -> None:
        late = max(0.0, took - planned)
        self.steps += 1
        self.planned_s += planned
        self.late_s += late
        index = next(i for i, le in enumerate(LATENESS_BUCKETS_MS) if 1e3 * late <= le)
        self.buckets[index] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "planned_s": round(self.planned_s, 6),
            "late_s": round(self.late_s, 6),
            "buckets_ms": {
                str(le): n for le, n in zip(LATENESS_BUCKETS_MS, self.buckets, strict=True)
            },
        }


@dataclass
class _Batch:
    prefill: list[tuple[SimRequest, int]] = field(default_factory=list)
    decode: list[SimRequest] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)


class Engine:
    def __init__(
        self,
        cost: CostModel,
        metrics: Metrics,
        engine_id: str,
        cache: CacheConfig | None = None,
        publish: Callable[[list[KVEvent]], None] | None = None,
        token_ids: Callable[[str], list[int]] | None = None,
        api: ApiProcess | None = None,
    ) -> None:
        """`api`: the API server process in front, shared by its data-parallel ranks."""
        self.cost = cost
        self.api = api or ApiProcess()
        self.engine_id = engine_id
        self.metrics = metrics
        self.cache = cache or CacheConfig()
        self.block_size = self.cache.block_size
        self.pool = BlockPool(
            cost.num_gpu_blocks, self.cache.enable_prefix_caching, self.block_size
        )
        self._publish = publish  # KV events, one batch per step (kv_events.py)
        self._token_ids = token_ids  # an output token's ids: the blocks decoding fills
        self.connector: KVConnector | None = None
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.remote_wait: set[SimRequest] = set()
        self.steps = 0  # steps started so far
        self._submissions = 0
        self.lateness = StepLateness()
        self._in_step = False  # between a step's start and its end
        self._step_end: float | None = None  # the model's end of the step just taken
        self._wake = asyncio.Event()

    # -- API used by the HTTP layer -------------------------------------------------
    async def api_path(self, prompt_tokens: int) -> None:
        """What vLLM's API server does before the scheduler sees a request: its intake on the
        server's one event loop, behind whatever the loop has taken on (other intakes, the
        running requests' tokens); the tokenization, which its renderer runs on a pool of
        `renderer_num_workers` threads, 1 by default: one prompt after another; and the rest
        (IPC to the engine core), concurrent."""
        loop = asyncio.get_running_loop()
        intake = self.cost.api_intake_ms / 1000.0
        if intake > 0:
            await asyncio.sleep(self.api.loop.take(intake, loop.time()))
        seconds = self.cost.api_overhead_ms / 1000.0
        tokenize = self.cost.tokenize_per_token_ms * prompt_tokens / 1000.0
        if tokenize > 0:
            seconds += self.api.tokenizer.take(tokenize, loop.time())
        if seconds > 0:
            await asyncio.sleep(seconds)

    def submit(self, req: SimRequest) -> None:
        if req.mode in (KVMode.PULL, KVMode.PUSH):
            req.fetch_stage = "waiting_to_start"
        req.block_size = self.block_size
        self._submissions += 1
        req.submitted = self._submissions
        if self.pool.caching:
            req.block_hashes = block_hashes(req.prompt_ids, self.block_size, req.scope)
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Client went away (or restart): drop the request and free its blocks now."""
        if req.state is State.FINISHED:
            return
        if req.state is State.WAITING:
            self._discard_waiting(req)
        self.remote_wait.discard(req)
        if req in self.running:
            self.running.remove(req)
        if self.connector is not None:
            self.connector.abort(req)
        self._finish(req, None)
        self._wake.set()

    def abort_all(self, message: str) -> None:
        for req in [*self.waiting, *self.remote_wait, *self.running]:
            self.abort(req)
            req.events.put_nowait(ErrorEvent(message, reset=True))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.remote_wait)

    # -- API used by connectors ------------------------------------------------------
    @property
    def step_now(self) -> int:
        """The step an event happening now belongs to: the one running or about to run."""
        return self.steps + 1 if not self._in_step else self.steps

    def kv_ready(self, req: SimRequest) -> None:
        """The main thread saw `req`'s transfer done (end of a step); decode from the next."""
        if req not in self.remote_wait:
            return
        req.note("kv_seen", self.steps)
        self.remote_wait.discard(req)
        req.fetch_stage = "completed_waiting"
        req.num_computed = req.prompt_tokens
        req.kv_from_transfer = True
        req.state = State.RUNNING
        self.running.append(req)
        self._cache_full_blocks(req)  # vLLM caches the received blocks too
        self._count_prompt_sources(req)
        self._wake.set()

    def kv_failed(self, req: SimRequest, message: str, recompute: bool) -> None:
        """A failed recv: recompute locally, or fail the request (policy "fail")."""
        if req not in self.remote_wait:
            return
        self.remote_wait.discard(req)
        self.metrics.lbl(self.metrics.nixl_failed_transfers).inc()
        if recompute:
            req.mode, req.fetch_stage = KVMode.RECOMPUTE, None
            req.state = State.RUNNING
            self.running.append(req)
        else:
            log.error("KV load failed for %s: %s", req.internal_id, message)
            self._finish(req, None)
            req.events.put_nowait(ErrorEvent("Internal server error"))
        self._wake.set()

    # -- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            self._wake.clear()
            self._admit()
            if self.connector is not None:
                self.connector.start_step()
            batch = self._plan()
            busy = bool(batch.prefill or batch.decode)
            if not busy and not self._must_step():
                self._step_end = None  # idle: the next step starts when its work comes
                await self._wake.wait()
                continue
            self.steps += 1
            self._in_step = True
            seconds = (
                step_seconds(self.cost, batch.num_prefill_tokens, len(batch.decode))
                if busy
                else self.cost.idle_step_ms / 1000.0
            )
            loop = asyncio.get_running_loop()
            began = self._step_start(loop.time())
            await asyncio.sleep(max(0.0, began + seconds - loop.time()))
            self.lateness.record(seconds, loop.time() - began)
            self._step_end = began + seconds
            self._in_step = False
            self._apply(batch)
            if self.connector is not None:
                # in arrival order: a set's order is its members' addresses, so a run on the
                # same inputs would order the running batch differently each time
                for req in sorted(self.connector.end_step(), key=lambda r: r.submitted):
                    self.kv_ready(req)
            self._publish_events()

    def _step_start(self, now: float) -> float:
        """Where a step starts on the model's timeline. One that follows another at once
        starts where the cost model ended that one, up to CATCH_UP_S in the past: a timer fires
        up to ~1 ms late (epoll counts whole milliseconds), which would otherwise add up over
        every step of a decode, whereas a GPU's next step, queued ahead by the host, does not
        wait for it. A process held up for longer than that stays late (step lateness)."""
        if self._step_end is None:
            return now
        return max(self._step_end, now - CATCH_UP_S)

    def reset_prefix_cache(self) -> bool:
        """POST /reset_prefix_cache: False (and nothing done) while a block is in use."""
        done = self.pool.reset_prefix_cache()
        self._publish_events()  # an idle engine takes no step that would send it
        return done

    def _publish_events(self) -> None:
        """What the step stored and evicted, as one KV event batch (as vLLM's scheduler)."""
        events = self.pool.take_events()
        if events and self._publish is not None:
            self._publish(events)

    def _must_step(self) -> bool:
        """An empty step is due when the connector has something a step hands over or sees.

        vLLM keeps stepping while requests wait for KV; here an idle engine waits for the
        connector's event (wake) and then takes its empty step, which costs the simulation no
        CPU between events and aligns the event to a step boundary all the same."""
        return self.connector is not None and self.connector.has_pending_work()

    def wake(self) -> None:
        """A connector event: an idle engine admits what now fits (a lease freed its blocks)
        and takes its next (empty) step if one is due."""
        self._wake.set()

    def _admit(self) -> None:
        """FIFO admission while blocks and sequence slots last (head-of-line blocking)."""
        while self.waiting:
            if len(self.running) + len(self.remote_wait) >= self.cost.max_num_seqs:
                return
            req = self.waiting[0]
            # The last prompt token is always computed (its logits give the first token).
            hit = self.pool.lookup(req.block_hashes, (req.prompt_tokens - 1) // self.block_size)
            need = blocks_for(req.prompt_tokens + req.max_tokens, self.block_size) - len(hit)
            blocks = self.pool.allocate(need, hit)
            if blocks is None:
                return
            self.waiting.popleft()
            req.blocks = blocks
            req.num_cached_blocks = req.num_hashed_blocks = len(hit)
            req.num_computed = req.num_cached_tokens
            if self.pool.caching:
                self.metrics.lbl(self.metrics.prefix_cache_queries).inc(req.prompt_tokens)
                self.metrics.lbl(self.metrics.prefix_cache_hits).inc(req.num_cached_tokens)
            req.note("allocated", self.steps + 1)
            if req.mode in (KVMode.PULL, KVMode.PUSH) and self.connector is not None:
                req.state = State.WAITING_FOR_REMOTE_KVS
                req.fetch_stage = "in_progress"
                self.remote_wait.add(req)
                self.connector.start_recv(req)
            else:
                req.state = State.RUNNING
                self.running.append(req)

    def _plan(self) -> _Batch:
        batch, budget = _Batch(), self.cost.max_num_batched_tokens
        for req in self.running:  # running requests first, in arrival order, like vLLM
            if budget <= 0:
                break
            if req.prefill_left > 0:
                chunk = min(req.prefill_left, budget)
                batch.prefill.append((req, chunk))
                budget -= chunk
            else:
                batch.decode.append(req)
                budget -= 1
        return batch

    def _apply(self, batch: _Batch) -> None:
        done: list[SimRequest] = []
        for req, chunk in batch.prefill:
            if req.state is not State.RUNNING:
                continue  # aborted during the step
            self._compute_kv(req, req.num_computed, req.num_computed + chunk)
            req.num_computed += chunk
            self._cache_full_blocks(req)
            if req.prefill_left == 0:
                self._count_prompt_sources(req)
                done.append(req)
        done.extend(r for r in batch.decode if r.state is State.RUNNING)
        outputs: list[tuple[SimRequest, Event]] = []
        for req in done:
            self._emit_token(req, outputs)
        self._stream(outputs)

    def _stream(self, outputs: list[tuple[SimRequest, Event]]) -> None:
        """A step's outputs go to the API server, whose one event loop detokenizes and sends
        each token in turn: the clients see them once the loop has done that, after what it
        had taken on before (intakes, earlier steps' tokens). In step order: each batch ends
        after the one before."""
        tokens = sum(isinstance(event, TokenEvent) for _, event in outputs)
        seconds = self.cost.stream_per_token_ms * tokens / 1000.0
        if seconds <= 0:
            _deliver(outputs)
            return
        loop = asyncio.get_running_loop()
        loop.call_later(self.api.loop.take(seconds, loop.time()), _deliver, outputs)

    def _compute_kv(self, req: SimRequest, start: int, end: int) -> None:
        """A prefill chunk (prompt tokens [start, end)): the blocks it touches get the
        prompt's fingerprint chain. Blocks before it (cached or earlier chunks) keep theirs."""
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        if not req.chain:  # once per request, however many chunks its prefill takes
            req.chain = fingerprints(req.prompt_ids, bs)
        self.pool.write(
            req.blocks[first:last],
            [BlockContent(fp, LOCAL, self.engine_id) for fp in req.chain[first:last]],
        )

    def _cache_full_blocks(self, req: SimRequest) -> None:
        """Enter the prompt blocks that are now full and computed into the prefix cache."""
        full = min(req.num_computed // self.block_size, len(req.block_hashes))
        if full > req.num_hashed_blocks:
            self.pool.cache(
                req.blocks[:full],
                req.block_hashes[:full],
                req.num_hashed_blocks,
                req.prompt_ids,
                req.session_id,
                req.scope,
            )
            req.num_hashed_blocks = full

    def _cache_generated(self, req: SimRequest, token: str) -> None:
        """As vLLM, blocks that generated tokens fill are cached too (the next turn of a
        conversation finds them). Each gets the content a prefill of its tokens would give.
        A token's KV is computed in the step after it is sampled, as the next input: the step
        that samples `token` completes the KV of the tokens before it."""
        if not self.pool.caching or self._token_ids is None:
            return
        bs, num_tokens = self.block_size, req.prompt_tokens + len(req.output_ids)
        req.output_ids += self._token_ids(token)
        full = min(num_tokens // bs, len(req.blocks))
        if full <= len(req.block_hashes):
            return
        all_ids = [*req.prompt_ids, *req.output_ids][:num_tokens]
        for index in range(len(req.block_hashes), full):
            [before] = self.pool.read([req.blocks[index - 1]]) if index else [None]
            fingerprint = block_fingerprint(index, before, all_ids[index * bs : (index + 1) * bs])
            self.pool.write([req.blocks[index]], [BlockContent(fingerprint, LOCAL, self.engine_id)])
        extend_hashes(req.block_hashes, all_ids[: full * bs], bs, req.scope)
        self.pool.cache(
            req.blocks[:full],
            req.block_hashes,
            req.num_hashed_blocks,
            all_ids,
            req.session_id,
            req.scope,
        )
        req.num_hashed_blocks = full

    def _count_prompt_sources(self, req: SimRequest) -> None:
        """vllm:prompt_tokens and prompt_tokens_by_source, once the prompt's KV is complete."""
        m, cached, external = self.metrics, req.num_cached_tokens, req.num_external_tokens
        m.lbl(m.prompt_tokens).inc(req.prompt_tokens)  # all of them, as vLLM (D's included)
        m.lbl(m.prompt_tokens_cached).inc(cached + external)
        m.lbl(m.prompt_by_source, source="local_cache_hit").inc(cached)
        m.lbl(m.prompt_by_source, source="external_kv_transfer").inc(external)
        m.lbl(m.prompt_by_source, source="local_compute").inc(req.prompt_tokens - cached - external)

    def _read_kv(self, req: SimRequest) -> None:
        """Decoding starts: read the prompt blocks, whatever they hold and wherever it came
        from. The output follows the content (cached blocks included); the label follows the
        evidence of the blocks this request filled."""
        held = self.pool.read(req.blocks[: req.num_prompt_blocks])
        req.context = context_seed(held)
        # The label says how this request filled its blocks: prefix-cache hits came earlier.
        evidence = Evidence.of(held[req.num_cached_blocks :])
        req.kv_label = evidence.label(_COMPUTED_HERE.get(req.mode, "recompute"))
        req.kv_evidence = evidence.as_dict()
        if req.num_cached_blocks:
            req.kv_evidence["cached_blocks"] = req.num_cached_blocks

    def _emit_token(self, req: SimRequest, outputs: list[tuple[SimRequest, Event]]) -> None:
        if req.num_output == 0:
            req.note("first_token", self.steps)
            self.metrics.lbl(self.metrics.ttft).observe(time.monotonic() - req.arrival)
            req.fetch_stage = None
            self._read_kv(req)
        token = output_token(req.context, req.num_output)
        self._cache_generated(req, token)
        final = req.num_output + 1 >= req.max_tokens
        outputs.append((req, TokenEvent(req.num_output, token, final)))
        req.num_output += 1
        self.metrics.lbl(self.metrics.generation_tokens).inc()
        if final:
            self.running.remove(req)
            params = None
            req.note("finished", self.steps)
            if req.mode is KVMode.PREFILL and self.connector is not None:
                params = self.connector.request_finished(req)  # takes over the blocks
            self._finish(req, params)
            outputs.append((req, FinishEvent("length", params)))

    def _finish(self, req: SimRequest, params: dict[str, Any] | None) -> None:
        req.state = State.FINISHED
        req.fetch_stage = None
        if params is None and req.blocks:
            self.pool.free(req.blocks)
        req.blocks = []

    def _discard_waiting(self, req: SimRequest) -> None:
        with contextlib.suppress(ValueError):
            self.waiting.remove(req)


def _deliver(outputs: list[tuple[SimRequest, Event]]) -> None:
    for req, event in outputs:
        req.events.put_nowait(event)
