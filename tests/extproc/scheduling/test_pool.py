"""Pool membership, health, in-flight counts and the decode fallback handed to Envoy."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack

import pytest

from extproc.config import parse_config
from extproc.policies import KvCachePicker, PickRequest, RoundRobinPicker
from extproc.roles import Role
from extproc.scheduling.pool import EndpointState, Pool, Start
from extproc.scheduling.shared_load import SharedLoad, table_bytes
from extproc.wiring import Runtime

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"


class Last:
    """A policy that takes the last candidate and remembers what it was offered."""

    def __init__(self) -> None:
        self.offered: list[list[str]] = []
        self.requests: list[PickRequest] = []

    def pick(self, candidates: Sequence[EndpointState], request: PickRequest) -> EndpointState:
        self.offered.append([c.address for c in candidates])
        self.requests.append(request)
        return candidates[-1]


def addresses(states: Sequence[EndpointState]) -> list[str]:
    return [s.address for s in states]


def test_configured_endpoints_start_healthy_and_idle() -> None:
    pool = Pool(Role.DECODE, [A, B], Last())
    assert [(s.address, s.healthy, s.in_flight) for s in pool] == [(A, True, 0), (B, True, 0)]
    assert pool.addresses == [A, B]


def test_update_reports_added_and_removed_and_keeps_known_state() -> None:
    changes: list[tuple[str, bool]] = []
    pool = Pool(Role.DECODE, [A, B], Last(), lambda s: changes.append((s.address, s.healthy)))
    pool.set_healthy(B, False)
    states = {s.address: s for s in pool}
    states[A].in_flight = 2
    changes.clear()
    added, removed = pool.update([A, C, B, C, D])
    assert (added, removed) == ([C, D], [])
    assert pool.addresses == [A, B, C, D]
    after = {s.address: s for s in pool}
    assert after[A] is states[A] and after[A].in_flight == 2
    assert not after[B].healthy  # known state kept
    assert not after[C].healthy and not after[D].healthy  # new: unhealthy until checked
    assert changes == [(C, False), (D, False)]  # each new endpoint is announced

    added, removed = pool.update([D, A])
    assert (added, removed) == ([], [B, C])
    assert pool.addresses == [A, D]


def test_new_endpoints_are_not_picked_until_healthy() -> None:
    pool = Pool(Role.DECODE, [A], Last())
    pool.update([A, B])
    assert pool.pick() is not None and pool.pick().address == A
    pool.set_healthy(B, True)
    assert pool.pick().address == B


def test_iterating_is_safe_while_membership_changes() -> None:
    pool = Pool(Role.DECODE, [A, B, C], Last())
    seen = []
    for state in pool:
        seen.append(state.address)
        pool.update([C])
    assert seen == [A, B, C]


def test_set_healthy_announces_only_real_changes() -> None:
    changes: list[tuple[str, bool]] = []
    pool = Pool(Role.DECODE, [A], Last(), lambda s: changes.append((s.address, s.healthy)))
    pool.set_healthy(A, True)
    pool.set_healthy("10.9.9.9:1", False)  # not a member: ignored
    pool.set_healthy(A, False)
    pool.set_healthy(A, False)
    pool.set_healthy(A, True)
    assert changes == [(A, False), (A, True)]
    assert "10.9.9.9:1" not in pool.addresses


def test_pick_offers_the_policy_only_healthy_members_of_the_group() -> None:
    policy = Last()
    pool = Pool(Role.DECODE, [A, B, C, D], policy)
    pool.set_healthy(C, False)
    request = PickRequest(model="m", session="s")
    assert pool.pick(request, among={A, C, D}).address == D
    assert policy.offered == [[A, D]] and policy.requests == [request]
    assert pool.pick(among={C}) is None
    assert pool.pick(among=set()) is None


def test_a_policy_given_to_pick_overrides_the_pools() -> None:
    own, given = Last(), Last()
    pool = Pool(Role.DECODE, [A, B], own)
    pool.pick(policy=given)
    assert (own.offered, given.offered) == ([], [[A, B]])
    replacement = Last()
    pool.set_policy(replacement)
    pool.pick()
    assert own.offered == [] and replacement.offered == [[A, B]]


@pytest.mark.parametrize(
    ("unhealthy", "among", "expected"),
    [
        ((), None, [D, A]),  # the fallback wraps round to the list's start
        ((A,), None, [D, B]),
        ((A, B, C), None, [D]),  # nothing else healthy: no fallback
        ((), {B, D}, [D, B]),  # only the model's members
        ((A, B, C, D), None, []),
    ],
)
def test_fallback_is_the_next_healthy_endpoint_after_the_choice(
    unhealthy: tuple[str, ...], among: set[str] | None, expected: list[str]
) -> None:
    pool = Pool(Role.DECODE, [A, B, C, D], Last())
    for address in unhealthy:
        pool.set_healthy(address, False)
    assert addresses(pool.pick_with_fallback(among=among)) == expected


def test_fallback_follows_the_choice_not_the_list_start() -> None:
    pool = Pool(Role.DECODE, [A, B, C, D], RoundRobinPicker())
    pool.set_healthy(D, False)
    picks = [addresses(pool.pick_with_fallback()) for _ in range(4)]
    # one policy call per request: round robin over A, B, C, fallback = next healthy
    assert picks == [[A, B], [B, C], [C, A], [A, B]]


def test_fallback_uses_the_request_group_and_policy_given() -> None:
    own, given = Last(), Last()
    pool = Pool(Role.DECODE, [A, B, C], own)
    request = PickRequest(model="m")
    assert addresses(pool.pick_with_fallback(request, among={A, B}, policy=given)) == [B, A]
    assert own.offered == [] and given.offered == [[A, B]] and given.requests == [request]


def test_track_counts_in_flight_even_when_the_request_fails() -> None:
    pool = Pool(Role.DECODE, [A], Last())
    [state] = pool
    with pool.track(state):
        assert state.in_flight == 1
        with pool.track(state):
            assert state.in_flight == 2
    assert state.in_flight == 0
    with pytest.raises(RuntimeError), pool.track(state):
        raise RuntimeError("leg failed")
    assert state.in_flight == 0


def test_a_count_moves_to_the_endpoint_that_served_and_ends_there() -> None:
    pool = Pool(Role.DECODE, [A, B], Last())
    first, fallback = pool
    with pool.track(first) as counted:
        counted.move_to(C)  # not a member (any more): the count stays
        counted.move_to(A)  # already there
        assert (first.in_flight, fallback.in_flight) == (1, 0)
        counted.move_to(B)
        assert (first.in_flight, fallback.in_flight) == (0, 1)
    assert (first.in_flight, fallback.in_flight) == (0, 0)  # released where it was moved


def test_each_configured_endpoint_is_in_the_metrics_under_its_role_from_the_start() -> None:
    config = parse_config(
        {"prefill": {"endpoints": ["127.0.0.1:8100"]}, "decode": {"endpoints": ["127.0.0.1:8200"]}}
    )
    registry = Runtime(config, "unix:/nonexistent").metrics.registry
    for role, address in (("prefill", "127.0.0.1:8100"), ("decode", "127.0.0.1:8200")):
        labels = {"role": role, "endpoint": address}
        assert registry.get_sample_value("pd_extproc_endpoint_healthy", labels) == 1
        assert registry.get_sample_value("pd_extproc_inflight_requests", labels) == 0


def test_a_released_count_is_counted_again_only_where_it_moves_and_only_once() -> None:
    pool = Pool(Role.PREFILL, [A, B], Last())
    a, b = pool
    with pool.track(a) as counted:
        counted.release()  # the P leg answered
        counted.release()
        assert (a.in_flight, b.in_flight) == (0, 0)
        counted.move_to(B)  # a retry there
        assert (a.in_flight, b.in_flight) == (0, 1)
        counted.move_to(B)
        assert b.in_flight == 1
    assert (a.in_flight, b.in_flight) == (0, 0)
    counted.move_to(A)  # its request has ended: nothing is counted any more
    assert (a.in_flight, b.in_flight) == (0, 0)


def test_ranks_are_chosen_by_their_load_and_counted_apart() -> None:
    """A rank's load: our in-flight requests there plus other routers' (the engine's scraped
    waiting + running beyond ours); ties go in turn."""
    pool = Pool(Role.PREFILL, [A, B], Last())
    pool.ranks_of = lambda address: 2 if address == A else 1
    state = next(s for s in pool if s.address == A)
    with pool.track(state) as first, pool.track(state) as second:
        assert (first.rank, second.rank) == (0, 1)  # idle ranks: in turn
        assert state.rank_in_flight == {0: 1, 1: 1} and state.in_flight == 2
        second.release()
        assert state.rank_in_flight == {0: 1, 1: 0}
        with pool.track(state) as third:
            assert third.rank == 1  # rank 0 is busier
    assert state.rank_in_flight == {0: 0, 1: 0} and state.in_flight == 0
    state.rank_load = {0: 0.0, 1: 5.0}  # the engine's queue at rank 1 (other routers' load)
    with pool.track(state) as a, pool.track(state) as b:
        assert (a.rank, b.rank) == (0, 0)
    other = next(s for s in pool if s.address == B)
    with pool.track(other) as plain:
        assert plain.rank is None and other.rank_in_flight == {}
        plain.move_to(A)  # a retry on the endpoint with ranks gets one of its ranks
        assert plain.rank in (0, 1) and state.rank_in_flight[plain.rank] == 1
    assert state.rank_in_flight == {0: 0, 1: 0}
    with pool.track(state, rank=1) as chosen, pool.track(state, rank=1) as again:
        assert (chosen.rank, again.rank) == (1, 1)  # chosen for its cache: kept, even busier
    with pool.track(other, rank=1) as none:
        assert none.rank is None  # B has no ranks: a chosen one is dropped
    pool.ranks_of = lambda address: 2
    with pool.track(state) as sent:
        rank = sent.rank
        sent.move_to(B)  # Envoy's fallback served it, with the rank header already sent
        assert sent.rank == rank and other.rank_in_flight == {rank: 1}
        assert state.rank_in_flight == {0: 0, 1: 0}


def test_a_leg_still_to_leave_takes_a_rank_of_its_new_endpoint() -> None:
    """A serial retry's P leg has sent no rank yet: it goes to the least loaded rank of the
    fallback, not the number the first endpoint's rank had."""
    pool = Pool(Role.PREFILL, [A, B], Last())
    pool.ranks_of = lambda address: 2
    first, fallback = (next(s for s in pool if s.address == a) for a in (A, B))
    fallback.rank_load = {0: 5.0, 1: 0.0}
    with pool.track(first, rank=0) as retried:
        retried.release()  # the first leg failed
        retried.move_to(B, same_rank=False)
        assert retried.rank == 1 and fallback.rank_in_flight == {1: 1}
    assert fallback.rank_in_flight == {1: 0} and fallback.in_flight == 0


def test_a_counts_pending_tokens_end_and_move_with_it() -> None:
    pool = Pool(Role.PREFILL, [A, B], Last())
    a, b = pool
    with pool.track(a, 100) as counted, pool.track(a, 20):
        assert (a.pending_tokens, b.pending_tokens) == (120, 0)
        counted.move_to(B)  # a fallback served it: its work is there now
        assert (a.pending_tokens, b.pending_tokens) == (20, 100)
        counted.release()
        assert (a.pending_tokens, b.pending_tokens) == (20, 0)
    assert (a.pending_tokens, b.pending_tokens) == (0, 0)


def test_what_a_request_in_flight_is_computing_is_not_settled_there() -> None:
    """A prompt start's leading tokens count as settled at an endpoint up to what a request of
    ours in flight there with that start found held at its pick, where its prompt reaches
    as far (it is computing the rest); the bound ends with the request, and does not follow
    it to another endpoint, where it found nothing."""
    pool = Pool(Role.PREFILL, [A, B], Last())
    a, b = pool
    assert a.settled(b"sys", 1024) == 1024  # nothing in flight: what the index says
    with pool.track(a, 1089, start=Start(b"sys", 0, 1089)) as first:
        with pool.track(a, 65, start=Start(b"sys", 1024, 1089)):
            assert a.settled(b"sys", 1024) == 0  # the first is computing it
            assert a.settled(b"sys", 2048) == 2048  # past its prompt: not its tokens
            assert a.settled(b"other", 1024) == 1024  # another start is not bounded
            first.release()  # its P leg answered: the prompt is there
            assert a.settled(b"sys", 1024) == 1024
            first.move_to(B)  # counted again elsewhere: not with what it found at A
            assert b.settled(b"sys", 1024) == 1024
        assert a.held_at_pick == {} and b.held_at_pick == {}
    with pool.track(a, 1089, start=Start(b"sys", 0, 1089)):  # two alike: one ending leaves
        with pool.track(a, 1089, start=Start(b"sys", 0, 1089)):  # the other's bound
            pass
        assert a.settled(b"sys", 1024) == 0


def _sharing_pools(rows: int = 2) -> list[Pool]:
    """`rows` processes' prefill pools over one shared table (as `up`'s workers are)."""
    table = bytearray(table_bytes(rows))
    pools = []
    for row in range(rows):
        pool = Pool(Role.PREFILL, ["p0", "p1"], KvCachePicker())
        pool.share(SharedLoad(table, rows, row, time.monotonic))
        pools.append(pool)
    return pools


def test_processes_sharing_a_table_weigh_each_others_queue_at_the_holder() -> None:
    """kv_cache keeps p0, which holds 512 of the prompt (worth 1024 queued tokens), while the
    work queued there is less: 8 requests of 88 uncached tokens (704 + 8 x 64 = 1216) sent
    by the other process are more, so this one goes to p1, as one process would."""
    mine, other = _sharing_pools()
    wanted = PickRequest(prefix=b"x", prompt_tokens=600, cached={"p0": 512})
    assert mine.pick(wanted) is mine.get("p0")
    with ExitStack() as inflight:
        for _ in range(8):
            inflight.enter_context(other.track(other.get("p0"), tokens=88))  # type: ignore[arg-type]
        assert mine.pick(wanted) is mine.get("p1")
        p0 = mine.get("p0")
        assert p0 is not None and (p0.in_flight, p0.peer_in_flight) == (0, 8)
        assert p0.peer_pending_tokens == 704
    assert mine.pick(wanted) is mine.get("p0")  # they ended: nothing queued there
    assert mine.get("p0").peer_in_flight == 0  # type: ignore[union-attr]


def test_an_endpoint_that_joins_later_is_shared_too() -> None:
    mine, other = _sharing_pools()
    for pool in (mine, other):
        pool.update(["p0", "p1", "p2"])
        pool.set_healthy("p2", True)
    with other.track(other.get("p2")):  # type: ignore[arg-type]
        mine.pick(PickRequest())
        assert mine.get("p2").peer_in_flight == 1  # type: ignore[union-attr]


def test_rank_ties_go_round_the_ranks_in_order_from_the_last_choice() -> None:
    state = EndpointState(A)
    assert state.rank_queue(2) == 0  # nothing known of a rank: nothing queued there
    assert [state.least_loaded_rank(3) for _ in range(4)] == [0, 1, 2, 0]
    state.rank_in_flight = {0: 1}  # rank 0 busy; 1 and 2 not seen yet, so idle
    state.next_rank = 0
    assert state.least_loaded_rank(3) == 1  # the first idle one after the busy rank


def test_a_moved_count_keeps_its_rank_only_where_the_new_endpoint_has_it() -> None:
    pool = Pool(Role.PREFILL, [A, B, C], Last())
    pool.ranks_of = lambda address: {A: 2, B: 2}.get(address, 1)
    a, b, c = pool
    with pool.track(a, rank=1) as sent:
        sent.move_to(B)  # Envoy's fallback, the rank header already sent: kept
        assert sent.rank == 1 and b.rank_in_flight == {1: 1}
        sent.move_to(C)  # no rank 1 there: none
        assert sent.rank is None and c.in_flight == 1
    with pool.track(a, rank=1) as retried:
        retried.release()
        retried.move_to(B, same_rank=False)  # still to leave: B's least loaded, not rank 1
        assert retried.rank == 0 and b.rank_in_flight == {0: 1, 1: 0}


def test_a_pool_without_a_scheduler_counts_no_rank() -> None:
    pool = Pool(Role.DECODE, [A], RoundRobinPicker())
    with pool.track(pool.get(A)) as counted:  # type: ignore[arg-type]
        assert counted.rank is None and pool.get(A).rank_in_flight == {}  # type: ignore[union-attr]
