"""pd-extproc's own request-side objects, built from a config file, with an in-process transport.

Built as `extproc.wiring.Runtime` builds them: the two pools with the config's policies, the
KV-cache routing (`KvRouting` over a `KvIndex`), the scheduler (admission, the decode-only
decision, in-flight and pending-token accounting), the identity cache, the P legs' sender with
its queued-token accounting (`TrackedPrefillSender`), and the legs' services. A request runs
the product's own path from the parsed body on: `parse_request`, `request_tokens`,
`plan_request`, then `start_dispatch`'s strategy (serial, parallel, decode-only), whose P leg
and Envoy answers are the only things replaced:

- Envoy and gRPC: the body answer the strategy writes is read back from the stand-in stream
  and its body sent to the plan's D in-process; D's response headers reach the strategy's
  `on_decode_headers` when the simulated engine starts its answer (a streaming answer);
- HTTP to P: `InProcessPrefill`, a `PrefillSender` that hands the body to the engine;
- the background loops: the engine scraper becomes a feed of each engine's own load numbers
  (its /metrics families, through `EngineLoad`) at the intervals of the scraper's plan; the KV
  event subscribers become in-process delivery of each engine's encoded batches, decoded by
  `decode_batch` and applied to the index as the ZMQ subscriber does; each prefill's identity
  is learnt at start by a one-token P leg, as the identity probe does. Health checks are not
  modelled: every engine stays healthy.

The `random` and `power_of_two` policies are built with generators seeded from the run's seed
(their constructors' `rng`), and the decision's stall buckets run on the simulated clock (the
`Decider`'s `clock`), so that a run is a function of its inputs.

Latencies the transport adds (`ProxyCosts`) are fixed per request; see docs/lab.md for where
the defaults come from.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import orjson

from extproc.config import Config
from extproc.engines.base_models import BaseModels
from extproc.engines.load import EngineLoad
from extproc.engines.scrape_plan import scrape_plan
from extproc.engines.scraper import parse_families
from extproc.errors import PrefillTimeout, RequestEnded
from extproc.headers import RANK_HEADER
from extproc.kvcache.events import MalformedBatch, decode_batch
from extproc.kvcache.index import KvIndex
from extproc.kvcache.routing import (
    KvRouting,
    approximated_groups,
    event_sources,
    kv_groups,
    rank_engine,
)
from extproc.metrics import Metrics
from extproc.policies import POLICIES
from extproc.protocol.bodies import prefill_kv_params
from extproc.protocol.identity import IdentityCache, identity_from_params, ranks_of
from extproc.request.parse import Api, parse_request
from extproc.request.plan import (
    DecodeOnlyPlan,
    Plan,
    land_on_decode,
    plan_request,
    request_tokens,
)
from extproc.request.prefill_client import (
    PrefillCall,
    PrefillResult,
    TrackedPrefillSender,
    prefill_error,
)
from extproc.request.pushed_kv import PushedKv
from extproc.request.strategies import Dispatch, Exchange, LegServices, start_dispatch
from extproc.roles import Role
from extproc.scheduling.decision import Decision
from extproc.scheduling.pool import EndpointState, Pool
from extproc.scheduling.scheduler import Scheduler, pool_picker
from extproc.scheduling.shared_load import SharedLoad
from extproc.tracing import RequestTrace
from lab.diagnostics import RecordingDecider, RecordingScheduler, request_detail
from lab.engines import MODEL, Cluster, Served, SimEngine
from lab.outcome import Outcome
from lab.tokenizer import TokenizerCosts, simulated_tokenizers

__all__ = ["ProxyCosts", "Sidecar"]

_PATH = Api.COMPLETIONS.value


@dataclass(frozen=True)
class ProxyCosts:
    """What the proxy adds to a request, in ms, fixed per request.

    intake: from the client's request to the legs leaving (Envoy, the ext_proc's decision);
    answer: the rest of the proxy's added latency, on the first token's way back;
    hop: one way between the proxy and an engine (each leg out, P's answer back).
    """

    intake_ms: float = 2.42
    answer_ms: float = 1.23
    hop_ms: float = 0.0


# bench/results/hotpath.md (1P1D, instant engines, sequential): pd-extproc's "client → P leg"
# p50 2.422 ms and "added" p50 3.65 ms; vllm-router's 0.322 ms and 1.93 ms.
PROXIES = {
    "pd-extproc": ProxyCosts(2.42, 3.65 - 2.42),
    "vllm-router": ProxyCosts(0.32, 1.93 - 0.32),
}


class _Stream:
    """Envoy's side of the ext_proc stream, as the strategies use it: what they write is kept
    (the D body is read from it); Envoy sends nothing more while it waits for the answers."""

    def __init__(self) -> None:
        self.written: list[Any] = []
        self._silent = asyncio.get_running_loop().create_future()

    async def write(self, response: Any) -> None:
        self.written.append(response)

    def next_message(self) -> asyncio.Future[Any]:
        return self._silent

    def take(self) -> None:
        return None

    def put_back(self, message: Any) -> None:
        pass

    def decode_body(self) -> tuple[bytes, str | None]:
        """The body the last body answer sends to D (a buffered request's), and the
        data-parallel rank header it sets for D (None: not set)."""
        for answer in reversed(self.written):
            if answer.HasField("request_body"):
                response = answer.request_body.response
                rank = next(
                    (
                        h.header.raw_value.decode() or h.header.value
                        for h in response.header_mutation.set_headers
                        if h.header.key.lower() == RANK_HEADER
                    ),
                    None,
                )
                return bytes(response.body_mutation.body), rank
        raise RuntimeError("the strategy wrote no body answer for D")


class InProcessPrefill:
    """A `PrefillSender`: P's body to the simulated engine, P's answer back as a result."""

    def __init__(self, cluster: Cluster, costs: ProxyCosts) -> None:
        self._cluster = cluster
        self._hop_s = costs.hop_ms / 1e3
        self.served: dict[str, Served] = {}  # P's leg by request id, until its request reads it

    async def send(self, call: PrefillCall) -> PrefillResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await _sleep(self._hop_s)
        try:
            async with asyncio.timeout(call.timeout_s):
                engine = self._cluster.by_address[call.endpoint]
                rank = (call.headers or {}).get(RANK_HEADER)
                served = await engine.serve(bytes(call.body), call.request_id, rank_header=rank)
                if call.request_id != "probe":
                    self.served[call.request_id] = served
        except TimeoutError:  # as the product's PrefillClient says it
            raise PrefillTimeout(
                504,
                f"the prefill engine did not answer within {call.timeout_s:g} s",
                detail=f"prefill {call.endpoint}",
            ) from None
        await _sleep(self._hop_s)
        if served.status >= 300:
            body = orjson.dumps({"error": {"message": served.error}})
            raise prefill_error(served.status, None, body, call.endpoint)
        return PrefillResult(
            served.status, served.kv_transfer_params, started, loop.time() - started
        )


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


def _seed_pickers(scheduler: Scheduler, config: Config, seed: str) -> None:
    """The policies that draw at random (`random`, `power_of_two`) are built anew with a
    generator seeded from `seed`, through their constructors' `rng`: each otherwise seeds its
    own from the OS, and a run would not be a function of its inputs."""
    pools = config.groups()
    for name, group in scheduler.groups.items():
        for role in (Role.PREFILL, Role.DECODE):
            pool = getattr(pools[name], role)
            factory = POLICIES[pool.policy].picker
            if "rng" in inspect.signature(factory).parameters:
                rng = random.Random(f"lab/{seed}/{name}/{role}")
                group.pickers[role] = factory(pool.options, rng=rng)  # type: ignore[call-arg]


class Sidecar:
    """One ext_proc process's request-side state over the lab's cluster."""

    def __init__(
        self,
        config: Config,
        cluster: Cluster,
        costs: ProxyCosts,
        seed: int = 1,
        instance: int = 0,
        tokenizer: TokenizerCosts | None = None,
    ) -> None:
        """`instance`: which of several ext_proc processes over the same cluster (each
        draws from its own generators); `tokenizer`: its clients send text, tokenized at
        these costs (None: token ids, passed on as they are)."""
        self.config = config
        self.cluster = cluster
        self.costs = costs
        self.metrics = Metrics()
        loop = asyncio.get_running_loop()
        dispatch = config.dispatch
        self.identities = IdentityCache(
            dispatch.flap_threshold,
            dispatch.flap_window_s,
            dispatch.serial_cooldown_s,
            clock=loop.time,
        )
        self.prefill = Pool(
            Role.PREFILL, config.static_addresses(Role.PREFILL), pool_picker(config.prefill)
        )
        self.decode = Pool(
            Role.DECODE, config.static_addresses(Role.DECODE), pool_picker(config.decode)
        )
        self.text_prompts = tokenizer is not None
        self.kv = KvRouting(
            KvIndex(config.kv_index.max_blocks),
            self.metrics,
            tokenizers=simulated_tokenizers(tokenizer or TokenizerCosts()),
        )
        self.kv.configure(kv_groups(config), approximated_groups(config))
        self.scheduler = RecordingScheduler(
            config, self.prefill, self.decode, self.metrics, self.kv
        )
        _seed_pickers(self.scheduler, config, f"{seed}/{instance}")
        # the decision's stall buckets refill in simulated time, as they would in real time
        self._decider = RecordingDecider(self.metrics, clock=loop.time)
        self.scheduler.decider = self._decider
        # what the subscribers would follow; nothing is started (no ZMQ): see `kv_events`
        self._follow_kv_events()
        self._prefill_sender = InProcessPrefill(cluster, costs)
        self.services = LegServices(
            TrackedPrefillSender(self._prefill_sender, self.prefill.get),
            self.identities,
            lambda prefill: self.prefill.set_healthy(prefill, False),
            lambda decode: None,  # the KV check's bookkeeping: not modelled
            self.metrics,
            pushed_kv=PushedKv(loop.time),
        )
        # a page that shows another number of ranks changes which sources are followed
        self._load = EngineLoad(self._state, lambda address: self._follow_kv_events())
        # the engines' base model, from the same pages: without it every request would be
        # keyed as a LoRA adapter's and the KV index would never credit an engine
        self._base_models = BaseModels(self.kv.learn_base_model)
        self.active_streams = 0  # requests this process is handling (Envoy balances on it)
        self._tasks: list[asyncio.Task[None]] = []
        self.shared_load: SharedLoad | None = None  # with the replica's other processes

    def share_load(self, table: SharedLoad) -> None:
        """Count the load of the replica's other processes too (`extproc.share_load`)."""
        self.shared_load = table
        self.prefill.share(table)
        self.decode.share(table)

    def _follow_kv_events(self) -> None:
        members = {name: g.members for name, g in self.scheduler.groups.items()}
        ranks = self.scheduler.data_parallel_size
        self.kv.follow(event_sources(self.config, members, self.kv.routed_groups, ranks))

    def _state(self, address: str) -> EndpointState | None:
        return self.prefill.get(address) or self.decode.get(address)

    # -- the background loops, in-process ---------------------------------------------------

    def kv_events(self, address: str, rank: int, payload: bytes) -> None:
        """An engine rank's KV event batch, as its ZMQ subscriber applies it, if one follows
        it: a data-parallel server's ranks are followed (and indexed) each on its own."""
        if address not in self.kv.watched:
            return
        role = Role.PREFILL if self.prefill.get(address) is not None else Role.DECODE
        if self.scheduler.data_parallel_size(role, address) > 1:
            engine = rank_engine(address, rank)  # followed on the port of its rank
        elif rank == 0:
            engine = address
        else:  # a rank this sidecar does not know of publishes on a port it does not follow
            return
        try:
            batch = decode_batch(payload)
        except MalformedBatch:
            self.kv.index.clear_engine(engine)
            return
        self.kv.index.apply(engine, batch.events)

    def scrape_intervals(self) -> dict[str, float]:
        """How often each engine's /metrics is read: the scraper's plan (`scrape_plan`), and
        every prefill engine at `health.interval_s` too (the health check's fetch)."""
        members = {name: g.members for name, g in self.scheduler.groups.items()}
        plan = scrape_plan(self.config, members, self.decode.addresses)
        health = self.config.health.interval_s
        for address in self.prefill.addresses:
            plan[address] = min(plan.get(address, health), health)
        return plan

    async def _feed_load(self, interval_s: float, engines: list[SimEngine]) -> None:
        while True:
            for engine in engines:
                families = parse_families(engine.load_page())
                self._load.consume(engine.address, families)
                self._base_models.consume(engine.address, families)
            await asyncio.sleep(interval_s)

    async def start(self) -> None:
        """Learn each prefill's identity (the probe), then keep the load numbers fresh."""
        if self.shared_load is not None:
            self.shared_load.start()
        by_interval: dict[float, list[SimEngine]] = {}
        for address, interval in self.scrape_intervals().items():
            by_interval.setdefault(interval, []).append(self.cluster.by_address[address])
        for interval, engines in sorted(by_interval.items()):
            self._tasks.append(asyncio.create_task(self._feed_load(interval, engines)))
        if self.config.dispatch.probe:
            probes = [
                self._probe(p, rank)
                for p in self.cluster.prefill
                for rank in ranks_of(self.scheduler.data_parallel_size(Role.PREFILL, p.address))
            ]
            await asyncio.gather(*probes)

    async def _probe(self, engine: SimEngine, rank: int | None) -> None:
        """One token to P (to each rank of a data-parallel one, pinned by vLLM's header), as
        the identity probe sends it: its answer names its engine."""
        body = orjson.dumps(
            {
                "model": MODEL,
                "prompt": [1],
                "max_tokens": 1,
                "kv_transfer_params": prefill_kv_params(f"probe-{engine.address}"),
            }
        )
        headers = None if rank is None else {RANK_HEADER: str(rank)}
        call = PrefillCall(engine.address, _PATH, body, "probe", 10.0, self.config, headers)
        result = await self.services.prefill_client.send(call)
        identity = identity_from_params(result.kv_transfer_params)
        self.identities.learn(engine.address, identity, rank)

    async def stop(self) -> None:
        if self.shared_load is not None:
            await self.shared_load.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.kv.stop()  # its tokenizers' threads (never started: prompts are ids)

    # -- one request ----------------------------------------------------------------------------

    async def handle(self, body: bytes, headers: Mapping[str, str]) -> Outcome:
        """The client's request from its arrival at the proxy to its last token."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        self.active_streams += 1
        try:
            return await self._handle(body, headers, sent)
        finally:
            self.active_streams -= 1

    async def _handle(self, body: bytes, headers: Mapping[str, str], sent: float) -> Outcome:
        loop = asyncio.get_running_loop()
        await _sleep(self.costs.intake_ms / 1e3)
        try:
            request = parse_request(Api.COMPLETIONS, body, self.config.limits.max_body_bytes)
            tokens = await request_tokens(request, self.scheduler)
            self.scheduler.seen, self._decider.last = None, None
            with ExitStack() as inflight:
                plan = plan_request(
                    request,
                    headers,
                    self.config,
                    self.scheduler,
                    self.identities,
                    inflight,
                    tokens=tokens,
                )
                picked = (self.scheduler.seen, self._decider.last)
                return await self._run(plan, sent, picked)
        except RequestEnded as error:
            return Outcome(False, error.status, str(error), finished_at=loop.time())

    async def _run(
        self, plan: Plan, sent: float, picked: tuple[dict[str, Any] | None, Decision | None]
    ) -> Outcome:
        """`picked`: what the scheduler saw and decided (the diagnostics')."""
        loop = asyncio.get_running_loop()
        stream = _Stream()
        exchange = Exchange(
            stream,  # type: ignore[arg-type]
            RequestTrace(),
            _PATH,
            {},
            plan.request_id,
            self.config,
            stream_answer=True,
        )
        dispatch = start_dispatch(plan, self.services, exchange, plan.prefill_counted)
        try:
            await dispatch.send(loop.time())
            body, rank = stream.decode_body()
            served, released = await self._decode(plan, body, rank, dispatch)
        finally:
            dispatch.close(False)
            p_served = self._prefill_sender.served.pop(plan.request_id, None)
        outcome = Outcome(
            served.status < 400,
            served.status,
            served.error,
            strategy="decode_only" if isinstance(plan, DecodeOnlyPlan) else str(plan.strategy),
            prefill=plan.prefill,
            decode=plan.decodes[0],
            finished_at=loop.time(),
        )
        prefill = None if isinstance(plan, DecodeOnlyPlan) else plan.prefill
        outcome.detail = request_detail(
            self.cluster,
            *picked,
            (p_served, served),
            (prefill, plan.decodes[0]),
            sent,
            released,
        )
        if outcome.ok and served.first_token_at is not None and served.last_token_at is not None:
            first = max(served.first_token_at, released) + self.costs.answer_ms / 1e3
            outcome.ttft_s = first - sent
            if served.output_tokens > 1:
                span = served.last_token_at - served.first_token_at
                outcome.tpot_s = span / (served.output_tokens - 1)
        return outcome

    async def _decode(
        self, plan: Plan, body: bytes, rank: str | None, dispatch: Dispatch
    ) -> tuple[Served, float]:
        """D's leg; D's headers go to the strategy when D starts its answer (a parallel
        plan holds them until P has answered). (D's outcome, when its headers passed.)"""
        loop = asyncio.get_running_loop()
        released: list[float] = []
        held: list[asyncio.Task[None]] = []

        async def hold(status: int) -> None:
            if await dispatch.on_decode_headers(status, True) and status < 400:
                land_on_decode(plan, self.scheduler.kv)
            released.append(loop.time())

        def on_headers(status: int) -> None:
            held.append(asyncio.create_task(hold(status)))

        await _sleep(self.costs.hop_ms / 1e3)
        engine = self.cluster.by_address[plan.decodes[0]]
        try:  # the longest a request may stay open (a D waiting for KV that never comes)
            async with asyncio.timeout(self.config.timeouts.request_s):
                served = await engine.serve(body, plan.request_id, on_headers, rank)
        except TimeoutError:
            served = Served(504, "the request outlived timeouts.request_s")
        for task in held:
            await task  # raises the P leg's failure (a LegError) where the strategy does
        return served, released[0] if released else loop.time()
