"""The pushes P still owes open streams: lost on a new engine or a down endpoint, in the window."""

from __future__ import annotations

from extproc.request.pushed_kv import PushedKv


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_new_engine_at_the_endpoint_loses_what_the_old_one_owed() -> None:
    pushed = PushedKv(Clock())
    old, new, other = (
        pushed.owe("p1", "e1", 5),
        pushed.owe("p1", "e2", 5),
        pushed.owe("p2", "e1", 5),
    )
    assert pushed.engine_changed("p1", "e2") == 1
    assert old.lost.done() and not new.lost.done() and not other.lost.done()
    assert len(pushed) == 2  # the lost one is forgotten; the others still owed


async def test_a_down_endpoint_loses_all_it_owed() -> None:
    pushed = PushedKv(Clock())
    owed = [pushed.owe("p1", engine, 5) for engine in ("e1", "e2")]
    assert pushed.endpoint_down("p1") == 2
    assert all(o.lost.done() for o in owed) and len(pushed) == 0
    assert pushed.endpoint_down("p1") == 0  # nothing twice


async def test_a_push_past_its_window_is_not_lost_but_forgotten() -> None:
    clock = Clock()
    pushed = PushedKv(clock)
    owed = pushed.owe("p1", "e1", 5)
    clock.now += 5.01  # its KV has had time to land: the stream is left alone
    assert pushed.engine_changed("p1", "e2") == 0
    assert not owed.lost.done() and len(pushed) == 0


async def test_released_pushes_are_never_told() -> None:
    pushed = PushedKv(Clock())
    owed = pushed.owe("p1", "e1", 5)
    pushed.release(owed)
    pushed.release(owed)  # a stream ends once; twice is harmless
    assert pushed.endpoint_down("p1") == 0 and not owed.lost.done() and len(pushed) == 0
