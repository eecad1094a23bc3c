"""The heap is trimmed once the big bodies are gone, never while one is held."""

from __future__ import annotations

import asyncio

from extproc.process.memory_trim import MemoryTrim
from extproc.request.body_budget import BodyBudget

LIMIT = 1 << 30


def recorded_trim() -> tuple[BodyBudget, MemoryTrim, list[int]]:
    """A budget, its trim, and the bytes in use at each trim."""
    budget = BodyBudget(big_bytes=100)
    trims: list[int] = []
    return budget, MemoryTrim(budget, quiet_s=0, trim=lambda: trims.append(budget.in_use)), trims


async def test_the_trim_runs_once_the_last_big_body_is_gone() -> None:
    budget, trim, trims = recorded_trim()
    big, small = budget.reservation(), budget.reservation()
    big.take(100, LIMIT)
    small.take(10, LIMIT)
    small.release()  # a small body's end calls for nothing (test_body_budget)
    big.release()
    assert await asyncio.wait_for(trim.once(), 5) is True
    assert trims == [0]


async def test_a_big_body_come_meanwhile_defers_the_trim() -> None:
    budget, trim, trims = recorded_trim()
    first, second = budget.reservation(), budget.reservation()
    first.take(100, LIMIT)
    first.release()
    second.take(100, LIMIT)  # before the quiet period is over
    assert await asyncio.wait_for(trim.once(), 5) is False
    assert trims == []
    second.release()
    assert await asyncio.wait_for(trim.once(), 5) is True
    assert trims == [0]


async def test_the_trim_task_is_stopped_by_its_owner() -> None:
    budget = BodyBudget(big_bytes=100)
    trimmed = asyncio.Event()
    trim = MemoryTrim(budget, quiet_s=0, trim=trimmed.set)
    trim.start()
    body = budget.reservation()
    body.take(100, LIMIT)
    body.release()
    await asyncio.wait_for(trimmed.wait(), 5)
    await trim.stop()
