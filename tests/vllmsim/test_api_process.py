"""The API server's one event loop takes in new requests and streams every running request's
tokens, one thing at a time: a request's path to the scheduler is short on an idle server and
grows with the number of requests it streams. Run on the lab's virtual clock (lab/clock.py), so
every time below is the cost model's, exactly, whatever the machine's speed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from lab.clock import run_virtual
from vllmsim.cli import build_parser, config_from_args
from vllmsim.config import CostModel
from vllmsim.engine import Engine, FinishEvent, SimRequest, TokenEvent
from vllmsim.metrics import Metrics

STEP_MS, INTAKE_MS, PER_TOKEN_MS = 10.0, 1.0, 0.5
COST = CostModel(
    step_base_ms=STEP_MS,
    prefill_per_token_ms=0.0,
    decode_per_seq_ms=0.0,
    api_overhead_ms=0.0,
    tokenize_per_token_ms=0.0,
    api_intake_ms=INTAKE_MS,
    stream_per_token_ms=PER_TOKEN_MS,
)
STREAMING = 8  # requests the server streams while the probe arrives
EPS = 1e-6


def _on_engine(body: Callable[[Engine], Awaitable[float]]) -> float:
    async def run() -> float:
        engine = Engine(COST, Metrics("m", 0.0), "e")
        task = asyncio.get_running_loop().create_task(engine.run())
        try:
            return await body(engine)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return run_virtual(run)


def _streaming(engine: Engine, count: int) -> list[SimRequest]:
    """`count` requests decoding from t = 0 (handed to the scheduler directly)."""
    reqs = [SimRequest(f"s{i}", [1, 2, 3], 1000) for i in range(count)]
    for req in reqs:
        engine.submit(req)
    return reqs


async def _intake(engine: Engine, at_s: float) -> float:
    """How long a request arriving at `at_s` takes from the HTTP request to the scheduler."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(at_s - loop.time())
    began = loop.time()
    await engine.api_path(3)
    return loop.time() - began


async def _first_token_at(req: SimRequest) -> float:
    event = await req.events.get()
    assert isinstance(event, TokenEvent) and event.index == 0
    return asyncio.get_running_loop().time()


def test_an_idle_server_takes_a_request_in_in_its_intake_time() -> None:
    took = _on_engine(lambda engine: _intake(engine, 0.011))
    assert abs(took - INTAKE_MS / 1e3) < EPS


def test_a_request_arriving_while_the_server_streams_waits_behind_that_work() -> None:
    async def body(engine: Engine) -> float:
        _streaming(engine, STREAMING)
        # the first step ends at 10 ms and hands 8 tokens (4 ms of streaming) to the loop:
        # a request arriving at 11 ms waits 3 ms, then takes its own 1 ms
        return await _intake(engine, 0.011)

    took = _on_engine(body)
    streamed = STREAMING * PER_TOKEN_MS
    assert abs(took - (STEP_MS + streamed - 11.0 + INTAKE_MS) / 1e3) < EPS


def test_a_step_s_tokens_reach_their_clients_once_the_loop_has_streamed_them() -> None:
    def first_token(count: int) -> float:
        async def body(engine: Engine) -> float:
            return await _first_token_at(_streaming(engine, count)[0])

        return _on_engine(body)

    assert abs(first_token(1) - (STEP_MS + PER_TOKEN_MS) / 1e3) < EPS
    assert abs(first_token(STREAMING) - (STEP_MS + STREAMING * PER_TOKEN_MS) / 1e3) < EPS


def test_intakes_and_tokens_share_the_one_loop_in_order() -> None:
    async def body(engine: Engine) -> float:
        [req] = _streaming(engine, 1)
        # four intakes booked at 9 ms keep the loop busy until 13 ms: the token of the step
        # ending at 10 ms is streamed after them
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0.009)
        intakes = [loop.create_task(engine.api_path(3)) for _ in range(4)]
        first = await _first_token_at(req)
        await asyncio.gather(*intakes)
        return first

    assert abs(_on_engine(body) - (9.0 + 4 * INTAKE_MS + PER_TOKEN_MS) / 1e3) < EPS


def test_without_the_loop_s_costs_events_are_delivered_at_the_step_s_end() -> None:
    async def run() -> float:
        cost = CostModel(step_base_ms=STEP_MS, prefill_per_token_ms=0.0, api_overhead_ms=0.0)
        engine = Engine(cost, Metrics("m", 0.0), "e")
        task = asyncio.get_running_loop().create_task(engine.run())
        try:
            req = SimRequest("r", [1, 2, 3], 2)
            engine.submit(req)
            first = await _first_token_at(req)
            while not isinstance(await req.events.get(), FinishEvent):
                pass
            return first
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    assert abs(run_virtual(run) - STEP_MS / 1e3) < EPS


def test_the_flags_set_the_loop_s_costs() -> None:
    args = build_parser().parse_args(["--api-intake-ms", "2.5", "--stream-per-token-ms", "0.2"])
    cost = config_from_args(args, {}).cost
    assert (cost.api_intake_ms, cost.stream_per_token_ms) == (2.5, 0.2)
    default = config_from_args(build_parser().parse_args(["--profile", "cpu-tiny"]), {}).cost
    assert (default.api_intake_ms, default.stream_per_token_ms) == (0.0, 0.0)
