"""The budget of client bodies one ext_proc process holds: taken as chunks arrive, refused past
the limit, given back once per request."""

from __future__ import annotations

import pytest

from extproc.errors import Shed
from extproc.request.body_budget import BodyBudget


def test_reservations_add_up_and_are_given_back_once() -> None:
    budget = BodyBudget()
    first, second = budget.reservation(), budget.reservation()
    first.take(60, 100)
    second.take(40, 100)  # exactly at the limit: accepted
    assert budget.in_use == 100
    first.release()
    first.release()  # a second release gives nothing back twice
    assert budget.in_use == 40
    second.release()
    assert budget.in_use == 0


def test_a_chunk_past_the_limit_is_shed_and_not_counted() -> None:
    budget = BodyBudget()
    held, late = budget.reservation(), budget.reservation()
    held.take(90, 100)
    with pytest.raises(Shed) as shed:
        late.take(11, 100)
    assert shed.value.status == 503 and shed.value.retry_after_s == 1
    assert budget.in_use == 90 and late.size == 0


def test_the_last_big_body_given_back_is_told_and_no_other() -> None:
    budget = BodyBudget(big_bytes=100)
    told: list[int] = []
    budget.on_big_bodies_gone = lambda: told.append(budget.in_use)
    first, second, small = budget.reservation(), budget.reservation(), budget.reservation()
    first.take(60, 1000)
    first.take(40, 1000)  # big from its second chunk on
    second.take(150, 1000)
    small.take(99, 1000)
    assert budget.big == 2
    small.release()  # a small body: never told
    first.release()  # a big one still held
    assert told == []
    second.release()
    assert told == [0] and budget.big == 0
    second.release()  # given back once: not told twice
    assert told == [0]
