"""The pushes P still owes open streams: lost on a new engine or a down endpoint, unless the
engine was seen alive long enough after its answer to have written them."""

from __future__ import annotations

from extproc.request.pushed_kv import PushedKv

LANDING_S, KEEP_S = 1.0, 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_new_engine_at_the_endpoint_loses_what_the_old_one_owed() -> None:
    pushed = PushedKv(Clock())
    old, new = (pushed.owe("p1", e, LANDING_S, KEEP_S) for e in ("e1", "e2"))
    other = pushed.owe("p2", "e1", LANDING_S, KEEP_S)
    assert pushed.engine_changed("p1", "e2") == 1
    assert old.lost.done() and not new.lost.done() and not other.lost.done()
    assert len(pushed) == 2  # the lost one is forgotten; the others still owed


async def test_a_down_endpoint_loses_all_it_owed() -> None:
    pushed = PushedKv(Clock())
    owed = [pushed.owe("p1", engine, LANDING_S, KEEP_S) for engine in ("e1", "e2")]
    assert pushed.endpoint_down("p1") == 2
    assert all(o.lost.done() for o in owed) and len(pushed) == 0
    assert pushed.endpoint_down("p1") == 0  # nothing twice


async def test_an_engine_seen_alive_after_the_landing_time_wrote_the_push() -> None:
    clock = Clock()
    pushed = PushedKv(clock)
    early = pushed.owe("p1", "e1", LANDING_S, KEEP_S)
    clock.now += 0.5
    late = pushed.owe("p1", "e1", LANDING_S, KEEP_S)
    clock.now += 0.6  # e1 answers again: 1.1 s after `early`, 0.6 s after `late`
    pushed.seen_alive("p1", "e1")
    clock.now += 0.1
    assert pushed.engine_changed("p1", "e2") == 1
    assert late.lost.done() and not early.lost.done()


async def test_another_engines_sign_of_life_proves_nothing() -> None:
    clock = Clock()
    pushed = PushedKv(clock)
    owed = pushed.owe("p1", "e1", LANDING_S, KEEP_S)
    clock.now += 2
    pushed.seen_alive("p1", "e2")  # the restarted engine answered first
    assert pushed.engine_changed("p1", "e2") == 1 and owed.lost.done()


async def test_a_loss_seen_after_the_keep_time_is_not_told() -> None:
    clock = Clock()
    pushed = PushedKv(clock)
    owed = pushed.owe("p1", "e1", LANDING_S, KEEP_S)
    clock.now += KEEP_S + 0.01  # too late to tell this loss from a stream long under way
    assert pushed.endpoint_down("p1") == 0
    assert not owed.lost.done() and len(pushed) == 0


async def test_released_pushes_are_never_told() -> None:
    pushed = PushedKv(Clock())
    owed = pushed.owe("p1", "e1", LANDING_S, KEEP_S)
    pushed.release(owed)
    pushed.release(owed)  # a stream ends once; twice is harmless
    assert pushed.endpoint_down("p1") == 0 and not owed.lost.done() and len(pushed) == 0


async def test_each_data_parallel_rank_owes_its_own_pushes() -> None:
    # keys as identity.where names them: a rank's new engine is not its sibling's
    pushed = PushedKv(Clock())
    rank0, rank1 = (pushed.owe(f"p1 dp{r}", f"e_dp{r}", LANDING_S, KEEP_S) for r in (0, 1))
    neighbour = pushed.owe("p10 dp0", "x_dp0", LANDING_S, KEEP_S)
    assert pushed.engine_changed("p1 dp1", "f_dp1") == 1
    assert rank1.lost.done() and not rank0.lost.done()
    assert pushed.endpoint_down("p1") == 1  # the server: every rank of it, not p10's
    assert rank0.lost.done() and not neighbour.lost.done()


async def test_a_loss_seen_after_the_landing_time_within_the_keep_time_is_told() -> None:
    # the push should have landed by now, but a P lost since its answer may be seen only now
    clock = Clock()
    pushed = PushedKv(clock)
    owed = pushed.owe("p1", "e1", LANDING_S, KEEP_S)
    clock.now += KEEP_S - 0.01
    assert pushed.endpoint_down("p1") == 1 and owed.lost.done()


async def test_every_push_of_the_old_engine_is_told_among_the_new_ones() -> None:
    pushed = PushedKv(Clock())
    old = [pushed.owe("p1", "e1", LANDING_S, KEEP_S) for _ in range(10)]
    new = [pushed.owe("p1", "e2", LANDING_S, KEEP_S) for _ in range(10)]
    assert pushed.engine_changed("p1", "e2") == 10
    assert all(o.lost.done() for o in old) and not any(o.lost.done() for o in new)


async def test_the_bounds_are_inclusive() -> None:
    clock = Clock()
    pushed = PushedKv(clock)
    written = pushed.owe("p1", "e1", LANDING_S, KEEP_S)
    clock.now += LANDING_S  # seen alive exactly when the push had to land: it did
    pushed.seen_alive("p1", "e1")
    assert pushed.engine_changed("p1", "e2") == 0 and not written.lost.done()
    owed = pushed.owe("p1", "e2", LANDING_S, KEEP_S)
    clock.now += KEEP_S  # a loss seen exactly at the keep time is still told
    assert pushed.endpoint_down("p1") == 1 and owed.lost.done()


async def test_an_endpoint_that_left_the_pool_has_no_sign_of_life_left() -> None:
    clock = Clock()
    pushed = PushedKv(clock)
    owed = [pushed.owe(key, "e1", LANDING_S, KEEP_S) for key in ("p1", "p1 dp1", "p10")]
    clock.now += 2 * LANDING_S
    for key in ("p1", "p1 dp1", "p10"):
        pushed.seen_alive(key, "e1")  # each wrote its push
    pushed.forget("p1")  # its ranks too: a later engine there proves nothing of e1's pushes
    assert pushed.engine_changed("p1", "e2") == 1 and owed[0].lost.done()
    assert pushed.engine_changed("p1 dp1", "e2") == 1 and owed[1].lost.done()
    # p10 is not a rank of p1: its record stayed
    assert pushed.engine_changed("p10", "e2") == 0 and not owed[2].lost.done()
