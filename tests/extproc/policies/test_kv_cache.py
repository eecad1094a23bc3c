"""The kv_cache policy's score: the prompt's cached tokens against the work queued ahead, all
of it (this sidecar's and other routers'), in one unit, for an endpoint and for a rank alike."""

from __future__ import annotations

import pytest

from extproc.policies import KvCacheOptions, KvCachePicker, PickRequest
from extproc.policies.base import hrw_order
from extproc.roles import Role
from extproc.scheduling.pool import EndpointState, Pool, Start

HOLDER, OTHER = "10.0.0.1:8000", "10.0.0.2:8000"
PROMPT = 1000
HELD = PickRequest(prefix=b"x", prompt_tokens=PROMPT, cached={HOLDER: PROMPT})


def test_a_prefix_still_being_computed_at_the_holder_counts_only_for_those_after() -> None:
    """Two requests of one new system prompt at once (the opening burst): the first's P is
    computing it, and the index already says that P holds it. The second waits there as long
    as computing it again on an idle P (1000 pending + 64), so the prefix saves it nothing
    and counts only once, for the requests after (1000 < 1064): the idle P. Computed (the
    first's leg ended, or it found the prefix held), it counts twice (2000 > 1064)."""
    pool = Pool(Role.PREFILL, [HOLDER, OTHER], KvCachePicker())
    holder, other = pool
    with pool.track(holder, PROMPT, start=Start(b"x", 0, PROMPT)):
        assert KvCachePicker().pick([holder, other], HELD) is other
    with pool.track(holder, PROMPT, start=Start(b"x", PROMPT, PROMPT)):
        assert KvCachePicker().pick([holder, other], HELD) is holder
    # Under load it counts twice, as the first will have computed it by the time this one's
    # turn comes there: no engine idle (the other has 100 tokens of its own: 2000 - 1564
    # against -164; once, 1000 - 1564 would lose), or two requests in flight at the holder.
    computing = Start(b"x", 0, PROMPT)
    with pool.track(holder, 1500, start=Start(b"x", 0, 1500)), pool.track(other, 100):
        assert KvCachePicker().pick([holder, other], HELD) is holder
    with (
        pool.track(holder, PROMPT, start=computing),
        pool.track(holder, 0, start=Start(b"x", PROMPT, PROMPT)),
    ):
        assert KvCachePicker().pick([holder, other], HELD) is holder
    # a weight of 3: still once for this request's wait, twice for those after (3000 ahead
    # of 1064 while the first computes it, 2000 counting twice for this one)
    heavier = KvCachePicker(KvCacheOptions(kv_cached_token_weight=3.0))
    with pool.track(holder, PROMPT, start=Start(b"x", 0, PROMPT)):
        assert heavier.pick([holder, other], HELD) is holder


def test_other_routers_queue_at_the_holder_outweighs_its_cache() -> None:
    # the default weight: 2 × 1000 cached tokens against 64 tokens per request queued there
    holder, other = EndpointState(HOLDER), EndpointState(OTHER)
    holder.foreign = 31  # seen at the last scrape, sent by other replicas: 1984 < 2000
    assert KvCachePicker().pick([other, holder], HELD) is holder
    holder.foreign = 32  # 2048 > 2000
    assert KvCachePicker().pick([other, holder], HELD) is other


@pytest.mark.parametrize("weight", [1.0, 2.0, 3.5])
def test_a_rank_weighs_cached_tokens_as_the_endpoint_choice_does(weight: float) -> None:
    picker = KvCachePicker(KvCacheOptions(kv_cached_token_weight=weight))
    holder_wins = []
    for queued in range(80):
        endpoint = picker.pick(
            [EndpointState(OTHER), EndpointState(HOLDER, in_flight=queued)], HELD
        )
        rank = picker.pick_rank([0, queued], {1: PROMPT}, PROMPT)
        assert (rank == 1) is (endpoint.address == HOLDER), queued
        holder_wins.append(rank == 1)
    # the holder wins while weight × 1000 tokens outweigh 64 per request queued there
    assert holder_wins.count(True) == int(weight * PROMPT / 64) + 1


def test_a_prompt_held_nowhere_goes_where_the_least_work_waits() -> None:
    # A new prompt (looked up, held by none): the engine with the least work queued, whatever
    # its rendezvous order; `prefix`'s bound on in-flight counts would allow one engine half
    # again its share (here 2 of 2 in flight, against 1 + 0), so a burst piled on it.
    new = PickRequest(prefix=b"x", prompt_tokens=PROMPT, cached={})
    picker = KvCachePicker()
    for prefix in (b"a", b"b", b"c", b"d", b"e", b"f"):
        busy, idle = EndpointState(HOLDER), EndpointState(OTHER)
        request = PickRequest(prefix=prefix, prompt_tokens=PROMPT, cached={})
        first = picker.pick([busy, idle], request)
        first.in_flight, first.pending_tokens = 1, PROMPT
        second = picker.pick([busy, idle], new)
        assert second is not first
    # not looked up (no tokenizer): nothing to weigh, `prefix`'s pick by the prompt's start
    unknown = PickRequest(prefix=b"x", prompt_tokens=0, cached=None)
    again = [picker.pick([EndpointState(HOLDER), EndpointState(OTHER)], unknown) for _ in range(3)]
    assert len({e.address for e in again}) == 1


def test_the_sidecars_other_processes_queue_at_the_holder_counts_as_this_ones() -> None:
    """The same bound as above, the queue sent by the sidecar's other ext_proc processes
    (their table): 15 requests of 2 uncached tokens (15 x 66 = 990) keep the holder; 16
    (1056 > 1000, the cache's 2 x 1000 less those of this process) send it away."""
    holder, other = EndpointState(HOLDER), EndpointState(OTHER)
    holder.in_flight, holder.pending_tokens = 15, 30  # this process's: 990
    holder.peer_in_flight, holder.peer_pending_tokens = 15, 30  # the others': 990
    assert KvCachePicker().pick([other, holder], HELD) is holder
    holder.peer_in_flight, holder.peer_pending_tokens = 16, 32
    assert KvCachePicker().pick([other, holder], HELD) is other


def test_a_rank_holding_what_outweighs_its_queue_wins_and_ties_go_to_the_less_busy() -> None:
    # weight 1, 64 tokens per queued request: rank 1's queue costs what 64 cached tokens save
    picker = KvCachePicker(KvCacheOptions(kv_cached_token_weight=1.0))
    assert picker.pick_rank([0, 1], {1: 65}, PROMPT) == 1  # one token ahead of idle rank 0
    assert picker.pick_rank([0, 1], {1: 64}, PROMPT) == 0  # even: the less loaded rank
    assert picker.pick_rank([0, 0, 0], {1: 5, 2: 5}, PROMPT) == 1  # even and idle: the first
    assert picker.pick_rank([0, 0], {1: 1}, 1) == 1  # a one-token prompt, held
    assert picker.pick_rank([0, 0], {1: 8}, 0) is None  # no prompt tokens: nothing to weigh


def test_a_one_token_prompt_is_weighed_and_one_of_no_counted_tokens_is_prefixs_pick() -> None:
    first, second = hrw_order(b"x", [EndpointState(HOLDER), EndpointState(OTHER)])
    # one token held by the second of the prompt's rendezvous order: weighed, it wins
    one = PickRequest(prefix=b"x", prompt_tokens=1, cached={second.address: 1})
    assert KvCachePicker().pick([first, second], one) is second
    # no tokens counted (not tokenized): `prefix`'s pick, whatever the work queued there
    first.pending_tokens = 10 * PROMPT
    none = PickRequest(prefix=b"x", prompt_tokens=0, cached={})
    assert KvCachePicker().pick([first, second], none) is first
