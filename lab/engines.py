"""The simulated cluster: vllmsim's own engines, prefix caches and NIXL connectors, in-process.

Each engine is vllmsim's `Engine` with its `PushConnector` or `PullConnector`, as `vllmsim`
runs it; what is replaced is the process boundary only:
- the HTTP API: a leg's body goes through vllmsim's own request parsing (`vllmsim.requests.
  parse`) and the engine's API path (`Engine.api_path`: the API server's loop and tokenizer
  thread, as modelled), then to the engine; its tokens come back as the engine emits them;
- the NIXL side channel: a message reaches the peer's connector in-process after the cost
  model's one-way latency (`side_channel.request` is replaced while the cluster runs);
- the KV event socket: each step's batch is encoded as vLLM's publisher encodes it and handed
  to `on_kv_events`, which the sidecar decodes as its ZMQ subscriber does.

A server may have several data-parallel ranks (vLLM's `--data-parallel-size`, vllmsim's
`-dp`): one API server in front, each rank its own engine, connector, side-channel port and
engine id `<id>_dp<rank>`, its events published with its rank; a leg goes to the rank its
X-data-parallel-rank header names, else to the least loaded, as vLLM balances.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from lab.workloads import prompt_ids
from vllmsim.config import CacheConfig, CostModel, Faults, KVTransferConfig, SimConfig
from vllmsim.cost_model import ApiProcess
from vllmsim.engine import Engine, ErrorEvent, FinishEvent, KVMode, SimRequest, TokenEvent
from vllmsim.kv_events import KVEvent, encode_batch
from vllmsim.metrics import Metrics
from vllmsim.nixl import side_channel
from vllmsim.nixl.base import ConnectorBase
from vllmsim.nixl.params import Identity
from vllmsim.nixl.pull import PullConnector
from vllmsim.nixl.push import PushConnector
from vllmsim.requests import ApiError, parse
from vllmsim.shapes import request_ids
from vllmsim.tokens import TokenCounter

__all__ = [
    "MODEL",
    "Cluster",
    "EngineTotals",
    "Queue",
    "Rank",
    "Served",
    "SimEngine",
    "Topology",
    "parse_topology",
]

MODEL = "lab-model"  # the engines' served model name; the lab's requests name it
_CONNECTORS = {"push": "NixlPushConnector", "pull": "NixlConnector"}
_FIRST_SIDE_PORT = 20_000  # the side channels' ports: only keys of the in-process delivery


@dataclass(frozen=True)
class Topology:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


def parse_topology(text: str) -> Topology:
    """`xPyD`, e.g. 2P2D; ValueError with what is wrong."""
    head, sep, tail = text.upper().partition("P")
    if not sep or not tail.endswith("D") or not head.isdigit() or not tail[:-1].isdigit():
        raise ValueError(f"--topology {text!r}: write it as xPyD, e.g. 2P2D")
    topology = Topology(int(head), int(tail[:-1]))
    if not (1 <= topology.prefill <= MAX_PER_ROLE and 1 <= topology.decode <= MAX_PER_ROLE):
        raise ValueError(f"--topology {text!r}: from 1 to {MAX_PER_ROLE} engines of each role")
    return topology


@dataclass
class Served:
    """One leg's outcome at an engine, and what the engine did with its prompt."""

    status: int = 200
    error: str = ""
    kv_transfer_params: dict[str, Any] | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # found in this engine's prefix cache
    transferred_tokens: int = 0  # brought by NIXL from P
    rank: int = 0  # the data-parallel rank that served it
    # diagnostics (simulated time): when the leg reached the API server and the scheduler,
    # and what the engine had queued then
    arrived_at: float = 0.0
    submitted_at: float = 0.0
    queue_on_arrival: Queue | None = None

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens this engine's forward passes computed."""
        if self.status >= 400:
            return 0
        return self.prompt_tokens - self.cached_tokens - self.transferred_tokens


@dataclass(frozen=True)
class Queue:
    """What an engine has in hand when a leg reaches its scheduler."""

    waiting: int  # for blocks or a turn (the scheduler's queue)
    remote_wait: int  # waiting for KV from P (not computing)
    running: int
    prefill_tokens: int  # prompt tokens still to compute, of waiting and running requests

    @classmethod
    def of(cls, engine: Engine) -> Queue:
        # a waiting request's cached prefix is known only once it is allocated: counted whole;
        # one whose KV comes from P computes nothing
        tokens = sum(
            r.prefill_left
            for r in [*engine.waiting, *engine.running]
            if r.mode not in (KVMode.PULL, KVMode.PUSH)
        )
        return cls(len(engine.waiting), len(engine.remote_wait), len(engine.running), tokens)


@dataclass
class EngineTotals:
    """What one engine did over a run (its own counts, not the sidecar's)."""

    legs: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    cached_tokens: int = 0
    peak_queue: int = 0  # waiting requests (for blocks, or for remote KV), at most
    rank_legs: dict[int, int] = field(default_factory=dict)  # legs by data-parallel rank

    def add(self, served: Served) -> None:
        self.legs += 1
        self.rank_legs[served.rank] = self.rank_legs.get(served.rank, 0) + 1
        self.prompt_tokens += served.prompt_tokens
        self.computed_tokens += served.computed_tokens
        self.cached_tokens += served.cached_tokens


@dataclass
class Rank:
    """One data-parallel engine rank of a server: its engine, its connector, and the requests
    the API server sent it that have not ended (vLLM's balancer counts them)."""

    index: int
    engine: Engine
    connector: ConnectorBase
    in_flight: int = 0

    @property
    def load(self) -> int:
        """vLLM's balancing score: its own in-flight count or the engine's queue and batch."""
        return max(self.in_flight, self.engine.num_waiting + len(self.engine.running))


@dataclass
class SimEngine:
    """One server (an API server and its engine ranks: one without data parallelism) and the
    front door of its API server."""

    address: str  # its name in the sidecar's pools
    name: str  # p0, p1, ..., d0, ...: in the lab's output
    role: str  # "prefill" | "decode"
    ranks: list[Rank]
    config: SimConfig
    tokens: TokenCounter = field(default_factory=TokenCounter)
    totals: EngineTotals = field(default_factory=EngineTotals)

    @property
    def engine(self) -> Engine:
        """Rank 0's engine (the only one without data parallelism)."""
        return self.ranks[0].engine

    @property
    def connector(self) -> ConnectorBase:
        return self.ranks[0].connector

    def choose_rank(self, header: str | None) -> Rank | None:
        """The rank a leg goes to, as vLLM chooses: X-data-parallel-rank's (None: out of
        range, a 400), else the least loaded, the lowest index on a tie."""
        if header is not None:
            try:
                wanted = int(header)
            except ValueError:
                wanted = None
            if wanted is not None:
                return self.ranks[wanted] if 0 <= wanted < len(self.ranks) else None
        return min(self.ranks, key=lambda r: (r.load, r.index))

    async def serve(
        self,
        body: bytes,
        request_id: str,
        on_headers: Callable[[int], None] = lambda status: None,
        rank_header: str | None = None,
    ) -> Served:
        """One leg: vllmsim's parsing of `body`, the API path, the engine; the tokens until
        the last. `request_id`: the leg's X-Request-Id, which the engine's own request id is
        made from (a push P pairs a serial D's registration with its blocks by it).
        `on_headers`: the answer's status, when a streaming server sends it; `rank_header`:
        the leg's X-data-parallel-rank."""
        try:
            parsed = parse(self.config, self.tokens, _read_text(orjson.loads(body)), chat=False)
        except (ApiError, orjson.JSONDecodeError) as error:
            status, message = (
                (error.status, error.message)
                if isinstance(error, ApiError)
                else (
                    400,
                    str(error),
                )
            )
            on_headers(status)
            return Served(status, message)
        _, internal_id = request_ids(request_id, chat=False)
        req = SimRequest(
            internal_id,
            parsed.prompt_ids,
            parsed.max_tokens,
            mode=parsed.mode,
            remote=parsed.kv_params,
        )
        rank = self.choose_rank(rank_header)
        if rank is None:
            on_headers(400)
            return Served(400, f"data_parallel_rank {rank_header} is out of range")
        engine = rank.engine
        rank.in_flight += 1
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        try:
            await engine.api_path(len(parsed.prompt_ids))
            on_headers(200)
            queue, submitted = Queue.of(engine), loop.time()
            engine.submit(req)
            waiting = sum(r.engine.num_waiting for r in self.ranks)
            self.totals.peak_queue = max(self.totals.peak_queue, waiting)
            try:
                served = await _collect(req)
            finally:
                engine.abort(req)  # nothing once finished; frees an abandoned leg's blocks
        finally:
            rank.in_flight -= 1
        served.rank = rank.index
        served.arrived_at, served.submitted_at, served.queue_on_arrival = arrived, submitted, queue
        served.prompt_tokens = req.prompt_tokens
        served.cached_tokens = req.num_cached_tokens
        served.transferred_tokens = req.num_external_tokens
        self.totals.add(served)
        return served

    def load_page(self) -> str:
        """The engine's load as its /metrics shows it (the families the sidecar reads)."""
        lines = []
        for rank in self.ranks:
            engine = rank.engine
            # vLLM's labels: its base model's name, and each rank's series its own `engine`
            labels = f'{{model_name="{MODEL}",engine="{rank.index}"}}'
            lines += [
                f"vllm:num_requests_waiting{labels} {engine.num_waiting}\n",
                f"vllm:num_requests_running{labels} {len(engine.running)}\n",
                f"vllm:kv_cache_usage_perc{labels} {engine.pool.usage()}\n",
            ]
        return "".join(lines)


async def _collect(req: SimRequest) -> Served:
    loop = asyncio.get_running_loop()
    served = Served()
    while True:
        event = await req.events.get()
        if isinstance(event, TokenEvent):
            now = loop.time()
            served.first_token_at = now if served.first_token_at is None else served.first_token_at
            served.last_token_at = now
            served.output_tokens += 1
        elif isinstance(event, FinishEvent):
            served.kv_transfer_params = event.kv_transfer_params
            return served
        elif isinstance(event, ErrorEvent):
            served.status, served.error = event.status, event.message
            return served


_NETWORKS = {"prefill": "192.0.2", "decode": "198.51.100"}  # documentation ranges (RFC 5737)
MAX_PER_ROLE = 254


def _address(role: str, index: int) -> str:
    """An engine's address in the pools: a name only, nothing is ever sent to it."""
    return f"{_NETWORKS[role]}.{index + 1}:8000"


class Cluster:
    """xPyD engines of one connector kind; the side channel and KV events in-process."""

    def __init__(
        self,
        topology: Topology,
        cost: CostModel,
        transfer: str,
        on_kv_events: Callable[[str, int, bytes], None],
        ranks: Mapping[str, int] | None = None,
        prefill_cost: CostModel | None = None,
    ) -> None:
        """`ranks`: role → engine ranks behind each server of that role (data parallelism;
        default 1); `on_kv_events(address, rank, batch)`; `prefill_cost`: the prefill engines'
        own (e.g. a smaller KV cache), else `cost`."""
        self.cost = cost
        self._prefill_cost = prefill_cost or cost
        self._on_kv_events = on_kv_events
        self._by_port: dict[int, ConnectorBase] = {}
        ranks = ranks or {}
        self.prefill = [
            self._server("prefill", i, transfer, ranks.get("prefill", 1))
            for i in range(topology.prefill)
        ]
        self.decode = [
            self._server("decode", i, transfer, ranks.get("decode", 1))
            for i in range(topology.decode)
        ]
        self.by_address = {e.address: e for e in self.all}
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def all(self) -> list[SimEngine]:
        return [*self.prefill, *self.decode]

    @staticmethod
    def addresses(topology: Topology) -> dict[str, list[str]]:
        """The engines' addresses by role, as the sidecar's pools list them."""
        return {
            "prefill": [_address("prefill", i) for i in range(topology.prefill)],
            "decode": [_address("decode", i) for i in range(topology.decode)],
        }

    def _server(self, role: str, index: int, transfer: str, ranks: int) -> SimEngine:
        address = _address(role, index)
        host = address.partition(":")[0]
        kv = KVTransferConfig(
            _CONNECTORS[transfer], "kv_producer" if role == "prefill" else "kv_consumer"
        )
        api = ApiProcess()  # one API server in front of its ranks
        cost = self._prefill_cost if role == "prefill" else self.cost
        base = str(uuid.UUID(int=_FIRST_SIDE_PORT + len(self._by_port)))  # never uuid4
        built = []
        for r in range(ranks):
            port = _FIRST_SIDE_PORT + len(self._by_port)  # vLLM: the side port + the rank
            engine_id = base if ranks == 1 else f"{base}_dp{r}"  # vLLM's rank engine ids

            def publish(events: list[KVEvent], rank: int = r) -> None:
                self._publish(address, rank, events)

            engine = Engine(cost, Metrics(MODEL, 0.0), engine_id, CacheConfig(), publish, api=api)
            cls = PushConnector if transfer == "push" else PullConnector
            connector = cls(engine, kv, Identity(engine_id, host, port), Faults())
            engine.connector = connector
            self._by_port[port] = connector
            built.append(Rank(r, engine, connector))
        config = SimConfig(served_model_names=(MODEL,), kv=kv, cost=cost)
        return SimEngine(address, f"{role[0]}{index}", role, built, config)

    def _publish(self, address: str, rank: int, events: list[KVEvent]) -> None:
        ts = asyncio.get_running_loop().time()
        self._on_kv_events(address, rank, encode_batch(ts, events, rank))

    async def _side_request(
        self, host: str, port: int, msg: dict[str, Any], latency_s: float, **_: Any
    ) -> dict[str, Any]:
        """side_channel.request, delivered to the connector of that port after the wire's
        latency (the only part of the TCP exchange the cost model prices)."""
        if latency_s > 0:
            await asyncio.sleep(latency_s)
        return await self._by_port[port].handle(msg)

    @contextlib.contextmanager
    def running(self) -> Iterator[Cluster]:
        """The engines' loops run and the side channel is delivered in-process meanwhile;
        `close` must be awaited after."""
        original = side_channel.request
        side_channel.request = self._side_request  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(r.engine.run()) for e in self.all for r in e.ranks]
        try:
            yield self
        finally:
            side_channel.request = original

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for e in self.all:
            for rank in e.ranks:
                await rank.connector.close()


def _read_text(doc: Any) -> Any:
    """A text prompt (`--tokenize`) as the engine's tokenizer reads it: the ids it was made of
    (`lab.workloads.prompt_text`), the sidecar's ids for it too."""
    if isinstance(doc, dict) and isinstance(doc.get("prompt"), str):
        doc["prompt"] = prompt_ids(doc["prompt"])
    return doc
