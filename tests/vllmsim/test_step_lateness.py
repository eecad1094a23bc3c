"""Step lateness: how much later than its cost model each engine step ended, per engine."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp

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
