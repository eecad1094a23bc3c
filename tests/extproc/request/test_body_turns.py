"""Big bodies' steps on the event loop one at a time, in order, with what else is ready run
between them; small bodies never wait; a turn held up too long is skipped."""

from __future__ import annotations

import asyncio

from extproc.request.body_turns import BodyTurns

BIG, SMALL = 1 << 20, 1000


async def test_big_steps_run_one_at_a_time_in_arrival_order_with_ready_work_between() -> None:
    turns = BodyTurns()
    order: list[str] = []

    async def big(name: str) -> None:
        for step in (1, 2):
            async with turns.turn(BIG):
                order.append(f"{name}{step}")
                # a small request's step that became ready meanwhile (its message arrived)
                asyncio.get_running_loop().call_soon(order.append, f"small after {name}{step}")
                await asyncio.sleep(0)  # a step with an await inside (a write) keeps its turn
                order.append(f"{name}{step} done")

    await asyncio.wait_for(asyncio.gather(big("a"), big("b")), 5)
    assert order == [
        "a1",
        "small after a1",
        "a1 done",
        "b1",
        "small after b1",
        "b1 done",
        "a2",
        "small after a2",
        "a2 done",
        "b2",
        "small after b2",
        "b2 done",
    ]


async def test_a_small_body_does_not_wait_for_a_big_ones_turn() -> None:
    turns = BodyTurns(wait_s=60)  # a small one that waited would time out below
    held, release = asyncio.Event(), asyncio.Event()

    async def big() -> None:
        async with turns.turn(BIG):
            held.set()
            await release.wait()

    holder = asyncio.create_task(big())
    await asyncio.wait_for(held.wait(), 5)
    entered = False
    async with asyncio.timeout(5), turns.turn(SMALL):
        entered = True
    assert entered and not holder.done()
    waiter = asyncio.create_task(_enter(turns, BIG))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not waiter.done()  # a big one waits
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, waiter), 5)


async def test_a_turn_held_up_past_its_bound_is_skipped_and_the_lock_stays_sound() -> None:
    turns = BodyTurns(wait_s=0.05)
    held, release = asyncio.Event(), asyncio.Event()

    async def stuck() -> None:
        async with turns.turn(BIG):
            held.set()
            await release.wait()

    holder = asyncio.create_task(stuck())
    await asyncio.wait_for(held.wait(), 5)
    await asyncio.wait_for(_enter(turns, BIG), 5)  # ran without a turn, after the bound
    release.set()
    await asyncio.wait_for(holder, 5)
    await asyncio.wait_for(_enter(turns, BIG), 5)  # the skipped turn released nothing twice


async def _enter(turns: BodyTurns, size: int) -> None:
    async with turns.turn(size):
        pass


async def test_a_lone_big_bodys_next_step_lets_ready_work_run_first() -> None:
    """No other big body waits, so its lock is free: the step must still yield before it runs,
    or two steps in a row would hold the loop as one long step."""
    turns = BodyTurns()
    order: list[str] = []
    async with turns.turn(BIG):
        order.append("step 1")
        asyncio.get_running_loop().call_soon(order.append, "small")
    async with turns.turn(BIG):
        order.append("step 2")
    assert order == ["step 1", "small", "step 2"]
