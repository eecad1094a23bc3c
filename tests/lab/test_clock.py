"""The virtual clock: the loop jumps to the next timer, and a stuck simulation raises."""

from __future__ import annotations

import asyncio

import pytest

from lab.clock import SimulationStuck, run_virtual


def test_timers_fire_in_order_at_their_simulated_times() -> None:
    async def scenario() -> list[tuple[str, float]]:
        loop, seen = asyncio.get_running_loop(), []

        async def after(name: str, seconds: float) -> None:
            await asyncio.sleep(seconds)
            seen.append((name, loop.time()))

        await asyncio.gather(after("late", 3600.0), after("early", 0.25))
        return seen

    assert run_virtual(scenario) == [("early", 0.25), ("late", 3600.0)]


def test_a_wait_for_what_never_comes_raises_instead_of_hanging() -> None:
    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SimulationStuck):
        run_virtual(stuck)
