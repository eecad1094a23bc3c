"""Step lateness: how much later than its cost model each engine step ended, per engine."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp

from lab.clock import VirtualLoop
from tests.vllmsim.vsim_helpers import get_json, post
from vllmsim.config import CostModel
from vllmsim.engine import Engine, FinishEvent, SimRequest
from vllmsim.launcher import FAST, running_engine
from vllmsim.metrics import Metrics

STEP = CostModel(step_base_ms=20.0, prefill_per_token_ms=0.0, decode_per_seq_ms=0.0)


async def _generate(engine: Engine, tokens: int) -> None:
    req = SimRequest("r", [1, 2, 3], tokens)
    engine.submit(req)
    while not isinstance(await asyncio.wait_for(req.events.get(), 5), FinishEvent):
        pass


async def test_a_step_the_event_loop_holds_up_is_counted_late_by_that_much() -> None:
    engine = Engine(STEP, Metrics("m"), "e")
    loop = asyncio.get_running_loop()
    task = loop.create_task(engine.run())
    try:
        await _generate(engine, 2)  # two 20 ms steps, on time
        on_time = engine.lateness.late_s
        # the next step's timer fires while the loop is busy for 60 ms
        loop.call_later(0.005, time.sleep, 0.06)
        await _generate(engine, 1)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    late = engine.lateness
    assert late.steps == 3
    assert abs(late.planned_s - 3 * 0.020) < 1e-9
    assert 0.035 <= late.late_s - on_time < 0.1
    # the held-up step lands in the (20, 50] ms bucket
    assert late.as_dict()["buckets_ms"]["50.0"] == 1


class _LateTimers(VirtualLoop):
    """A virtual clock whose every timed wait ends TIMER_LATE_S after its deadline, as epoll's
    millisecond timeouts end a real one."""

    TIMER_LATE_S = 0.0007

    def __init__(self) -> None:
        super().__init__()
        select = self._clock.select
        self._clock.select = lambda timeout=None: select(  # type: ignore[method-assign]
            timeout + self.TIMER_LATE_S if timeout else timeout
        )


def test_late_timers_do_not_add_up_over_a_decode() -> None:
    """50 back-to-back 20 ms steps end 1 s after the first began, plus one timer's lateness,
    not 50 of them (35 ms more)."""

    async def decode() -> float:
        engine = Engine(STEP, Metrics("m"), "e")
        task = asyncio.get_running_loop().create_task(engine.run())
        try:
            began = asyncio.get_running_loop().time()
            await _generate(engine, 50)
            return asyncio.get_running_loop().time() - began
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    loop = _LateTimers()
    try:
        took = loop.run_until_complete(decode())
    finally:
        loop.close()
    assert 50 * 0.020 <= took <= 50 * 0.020 + 2 * _LateTimers.TIMER_LATE_S


async def test_the_engine_state_reports_its_steps_lateness(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST) as eng:
        before = (await get_json(http, eng, "/sim/state"))["step_lateness"]
        body = {"model": "sim-model", "prompt": "hi", "max_tokens": 3}
        status, _ = await post(http, eng, "/v1/completions", body)
        assert status == 200
        after = (await get_json(http, eng, "/sim/state"))["step_lateness"]
    assert after["steps"] - before["steps"] >= 3
    assert after["planned_s"] > before["planned_s"]
    assert sum(after["buckets_ms"].values()) == after["steps"]
