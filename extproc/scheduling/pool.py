"""Endpoint pools: who is healthy, how busy each endpoint is, and which one to pick.

The choice itself is a policy (`extproc.policies`) over the healthy endpoints; in-flight counts
are kept here and taken/released in one context manager so that no error path leaks a count.
An endpoint with data-parallel ranks (one vLLM server, N engines) also gets a rank per counted
request: the least loaded one, as vLLM's own balancer scores them (the greater of our in-flight
count there and the engine's scraped waiting + running), ties taken in turn. With other
ext_proc processes of the same sidecar (`up`'s workers), every count is published to the
table they share and theirs are read before each pick (`extproc.scheduling.shared_load`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from extproc.policies.base import Picker, PickRequest
from extproc.roles import Role
from extproc.scheduling.shared_load import SharedLoad

__all__ = ["Counted", "EndpointState", "Pool", "Start"]


@dataclass(frozen=True, slots=True)
class Start:
    """A KV-routed request's prompt as an endpoint held it at the pick."""

    prefix: bytes  # the prompt's start (`PickRequest.prefix`)
    held: int  # its leading tokens the endpoint held
    tokens: int  # its tokens


@dataclass(eq=False)
class EndpointState:
    address: str
    healthy: bool = True
    in_flight: int = 0  # requests this ext_proc has in flight there
    waiting: float = 0.0  # the engine's vllm:num_requests_waiting, when scraped
    running: float = 0.0  # the engine's vllm:num_requests_running, when scraped
    queued_tokens: int = 0  # prefill: prompt tokens of the P legs this ext_proc has there
    # KV-cache routing: the prompt tokens of the requests (legs) counted here that the engine
    # did not hold when they were picked: what it computes (P), or takes in by transfer (D)
    pending_tokens: int = 0
    # the engine's running + waiting requests beyond this ext_proc's in-flight ones at the
    # last scrape: load other routers sent (ours is known exactly, and fresher, in in_flight)
    foreign: float = 0.0
    kv_usage: float = 0.0  # the engine's vllm:kv_cache_usage_perc (0-1), when scraped
    # data-parallel ranks: requests this ext_proc has in flight at each, and each engine's
    # scraped waiting + running (its `engine` label on /metrics) beyond those at the scrape:
    # as `foreign`, so that a scrape taken while our own request ran does not count it twice
    rank_in_flight: dict[int, int] = field(default_factory=dict)
    rank_load: dict[int, float] = field(default_factory=dict)
    next_rank: int = 0  # where the next rank choice starts looking: ties go in turn
    # the sidecar's other ext_proc processes' in_flight, pending_tokens and queued_tokens here
    # (`extproc.scheduling.shared_load`), as of this endpoint's last pick or scrape
    peer_in_flight: int = 0
    peer_pending_tokens: int = 0
    peer_queued_tokens: int = 0
    peer_alone_tokens: int = 0  # decode: prompts they sent it to prefill alone, not yet due
    # decode: the decision's stall bucket as the latest of them left it (at 0: none told)
    peer_stall_credit_ms: float = 0.0
    peer_stall_at: float = 0.0
    role: Role | None = None  # its pool's, which keys it in the shared table
    shared: SharedLoad | None = field(default=None, repr=False)  # None: one process alone
    # KV-cache routing: per prompt start (`PickRequest.prefix`), our requests in flight here
    # as (leading tokens found held at the pick, prompt tokens): how many of each
    held_at_pick: dict[bytes, Counter[tuple[int, int]]] = field(default_factory=dict, repr=False)

    def settled(self, prefix: bytes, cached: int) -> int:
        """Of `cached` leading tokens of a prompt starting with `prefix`, those not still being
        computed (or taken in) here for one of our requests in flight: one that found fewer
        held at its pick and whose prompt reaches as far is computing the rest (the index
        credits blocks as soon as the engine schedules them), and a request sent here now
        waits for them as for its own. One whose prompt ends sooner went its own way."""
        found = self.held_at_pick.get(prefix, ())
        return min([cached, *(held for held, tokens in found if held < cached <= tokens)])

    def publish(self) -> None:
        """This process's counts here, for the others (a change of any of them)."""
        if self.shared is not None and self.role is not None:
            self.shared.publish(
                self.role, self.address, self.in_flight, self.pending_tokens, self.queued_tokens
            )

    def publish_alone(self, tokens: int, due: float, stall_credit_ms: float, at: float) -> None:
        """Prompts this process sent here to prefill alone (the decision's), the last due at
        `due`, and its stall bucket here, `stall_credit_ms` at `at` (the decider's clock)."""
        if self.shared is not None and self.role is not None:
            self.shared.publish_alone(self.role, self.address, tokens, due, stall_credit_ms, at)

    def refresh_peers(self) -> None:
        """The others' counts here, now."""
        if self.shared is not None and self.role is not None:
            peers = self.shared.peers(self.role, self.address)
            self.peer_in_flight = peers.in_flight
            self.peer_pending_tokens = peers.pending_tokens
            self.peer_queued_tokens = peers.queued_tokens
            self.peer_alone_tokens = peers.alone_tokens
            self.peer_stall_credit_ms = peers.stall_credit_us / 1e3
            self.peer_stall_at = peers.stall_at_ns / 1e9

    @property
    def scraped_ranks(self) -> int:
        """The ranks its /metrics shows (`engine` labels 0 .. N-1); 1 when not scraped."""
        ranks = self.rank_load
        return len(ranks) if len(ranks) > 1 and set(ranks) == set(range(len(ranks))) else 1

    def rank_queue(self, rank: int) -> float:
        """The requests at `rank`: ours in flight (exact) and other routers' (scraped)."""
        return self.rank_in_flight.get(rank, 0) + self.rank_load.get(rank, 0.0)

    def least_loaded_rank(self, ranks: int) -> int:
        """The rank of `ranks` to send the next request to: the fewest requests."""
        order = [(self.next_rank + i) % ranks for i in range(ranks)]
        self.next_rank = (self.next_rank + 1) % ranks
        return min(order, key=self.rank_queue)


_ANY = PickRequest()  # probes and tools: nothing known of the request


class Pool:
    """The endpoints of one role (prefill or decode)."""

    def __init__(
        self,
        role: Role,
        addresses: Sequence[str],
        policy: Picker,
        # an endpoint joined, or its health changed (not its counts: they change per leg)
        on_change: Callable[[EndpointState], None] = lambda state: None,
    ) -> None:
        self.role = role
        self._endpoints = {a: EndpointState(a, role=role) for a in addresses}
        self._policy = policy
        self._shared: SharedLoad | None = None
        self._on_change = on_change
        # an endpoint's data-parallel ranks (1: none, no rank is chosen); set by the scheduler
        self.ranks_of: Callable[[str], int] = lambda address: 1

    def update(self, addresses: Sequence[str]) -> tuple[list[str], list[str]]:
        """New membership from discovery or a reload: (added, removed) addresses.

        Known endpoints keep their state; new ones start unhealthy until a health check
        passes; removed ones are forgotten here while their in-flight requests finish.
        """
        wanted = dict.fromkeys(addresses)  # a dict: ordered, and each lookup is O(1)
        added = [a for a in wanted if a not in self._endpoints]
        removed = [a for a in self._endpoints if a not in wanted]
        for address in removed:
            del self._endpoints[address]
        for address in added:
            self._endpoints[address] = EndpointState(
                address, healthy=False, role=self.role, shared=self._shared
            )
            self._on_change(self._endpoints[address])
        return added, removed

    def forget_alone(self, address: str) -> None:
        """The endpoint left: what the decision sent it counts no more for the others, and
        its slot in this process's row of the shared table can be reused."""
        if self._shared is not None:
            self._shared.publish_alone(self.role, address, 0, 0.0)

    def share(self, table: SharedLoad | None) -> None:
        """Count every endpoint with the sidecar's other ext_proc processes, through `table`
        (None: this process alone)."""
        self._shared = table
        for state in self._endpoints.values():
            state.shared = table

    def set_policy(self, policy: Picker) -> None:
        self._policy = policy

    @property
    def addresses(self) -> list[str]:
        return list(self._endpoints)

    def get(self, address: str) -> EndpointState | None:
        return self._endpoints.get(address)

    def __iter__(self) -> Iterator[EndpointState]:
        return iter(list(self._endpoints.values()))  # a copy: membership may change meanwhile

    def pick(
        self,
        request: PickRequest = _ANY,
        among: Collection[str] | None = None,
        policy: Picker | None = None,
    ) -> EndpointState | None:
        """A healthy endpoint (of `among`, a model's members, if given) chosen by `policy`."""
        healthy = [
            e
            for e in self._endpoints.values()
            if e.healthy and (among is None or e.address in among)
        ]
        if self._shared is not None:
            for state in healthy:
                state.refresh_peers()
        return (policy or self._policy).pick(healthy, request) if healthy else None

    def pick_with_fallback(
        self,
        request: PickRequest = _ANY,
        among: Collection[str] | None = None,
        policy: Picker | None = None,
        fallbacks: int = 1,
    ) -> list[EndpointState]:
        """The policy's choice, then up to `fallbacks` next healthy endpoints for Envoy's
        connect-failure retry.

        The fallbacks are taken in list order, not from the policy, so they do not advance it.
        """
        first = self.pick(request, among, policy)
        if first is None:
            return []
        ordered = [e for e in self._endpoints.values() if among is None or e.address in among]
        start = ordered.index(first)
        after = [s for s in ordered[start + 1 :] + ordered[:start] if s.healthy]
        return [first, *after[:fallbacks]]

    def set_healthy(self, address: str, healthy: bool) -> None:
        state = self._endpoints.get(address)
        if state is not None and state.healthy != healthy:
            state.healthy = healthy
            self._on_change(state)

    @contextmanager
    def track(
        self,
        state: EndpointState,
        tokens: int = 0,
        rank: int | None = None,
        start: Start | None = None,
    ) -> Iterator[Counted]:
        """Count one request in flight at `state` until the block ends (or its `release`),
        with `tokens` of work there (`pending_tokens`; they move with it). `rank`: the
        data-parallel rank chosen for it (by its cached prefix), else the least loaded.
        `start`: what `state` held of its prompt at the pick (KV-cache routing;
        `EndpointState.settled`)."""
        if rank is None or rank >= self.ranks_of(state.address):
            rank = self._rank_for(state)
        counted = Counted(self, state, rank, tokens, start)
        self._count(counted, +1)
        try:
            yield counted
        finally:
            self.release(counted)
            counted.open = False

    def move(self, counted: Counted, address: str, same_rank: bool = True) -> None:
        """Count `counted`'s request at `address` from now on: Envoy's fallback served it, or a
        retry went there (counted again after its release). Nothing once its `track` ended.
        `same_rank`: the rank already sent is kept where the new endpoint has it (Envoy's
        fallback D got the same header); False: the leg is still to leave (a retry's P leg),
        and the new endpoint's own least loaded rank is chosen."""
        state = self._endpoints.get(address)
        if not counted.open or state is None:
            return
        if state is counted.state and counted.counting:
            return
        self.release(counted)
        if state is not counted.state:
            kept = (
                same_rank
                and counted.rank is not None
                and counted.rank < self.ranks_of(state.address)
            )
            counted.rank = counted.rank if kept else self._rank_for(state)
            counted.start = None  # what it found held was another endpoint's
        counted.state, counted.counting = state, True
        self._count(counted, +1)

    def release(self, counted: Counted) -> None:
        """Stop counting `counted` (its leg ended before the request did); once only."""
        if counted.counting:
            counted.counting = False
            self._count(counted, -1)

    def _rank_for(self, state: EndpointState) -> int | None:
        ranks = self.ranks_of(state.address)
        return state.least_loaded_rank(ranks) if ranks > 1 else None

    def _count(self, counted: Counted, change: int) -> None:
        """No `on_change`: the counts are read where they are needed (the metric when scraped)."""
        state = counted.state
        state.in_flight += change
        state.pending_tokens += change * counted.tokens
        if counted.start is not None:
            _note_held(state.held_at_pick, counted.start, change)
        state.publish()
        if counted.rank is not None:
            state.rank_in_flight[counted.rank] = state.rank_in_flight.get(counted.rank, 0) + change


class Counted:
    """One request counted in flight at an endpoint of `pool`, from its `track` until that
    ends or, earlier, until `release` (a P leg is counted only while it runs)."""

    def __init__(
        self,
        pool: Pool,
        state: EndpointState,
        rank: int | None = None,
        tokens: int = 0,
        start: Start | None = None,
    ) -> None:
        self.pool = pool
        self.state = state
        self.rank = rank  # the data-parallel rank it goes to (None: the endpoint has none)
        self.tokens = tokens  # its pending_tokens wherever it is counted
        self.start = start  # KV-cache routing: what it found held there at its pick
        self.counting = True  # counted at `state` now
        self.open = True  # its `track` has not ended: it may be counted again

    def move_to(self, address: str, same_rank: bool = True) -> None:
        self.pool.move(self, address, same_rank)

    def release(self) -> None:
        self.pool.release(self)


def _note_held(
    held_at_pick: dict[bytes, Counter[tuple[int, int]]], start: Start, change: int
) -> None:
    counts = held_at_pick.setdefault(start.prefix, Counter())
    key = (start.held, start.tokens)
    counts[key] += change
    if counts[key] <= 0:
        del counts[key]
        if not counts:
            del held_at_pick[start.prefix]
