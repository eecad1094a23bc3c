"""NIXL push and pull aligned to the engines' step loops, read from the request records' event
timelines (GET /sim/requests: (event, step, time) per request, on P and on D)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.vllmsim.vsim_helpers import d_body, eventually, identity, p_body, post, record
from vllmsim.launcher import FAST, PULL_D, PULL_P, PUSH_D, PUSH_P, EngineHandle, running_engine

Timeline = dict[str, tuple[int, float]]  # event -> (engine step, wall time)


async def timeline(http: aiohttp.ClientSession, eng: EngineHandle, rid: str) -> Timeline:
    events = (await record(http, eng, rid))["events"]
    return {name: (step, at) for name, step, at in events}


async def p_timeline(http: aiohttp.ClientSession, p: EngineHandle, rid: str) -> Timeline:
    """P's events, once its writer has finished the WRITE (after P's own answer)."""

    async def written() -> bool:
        return "write_done" in await timeline(http, p, rid)

    await eventually(written)
    return await timeline(http, p, rid)


def step(t: Timeline, event: str) -> int:
    return t[event][0]


def at(t: Timeline, event: str) -> float:
    return t[event][1]


async def serial_exchange(
    http: aiohttp.ClientSession, p: EngineHandle, d: EngineHandle, rid: str
) -> None:
    status, pr = await post(http, p, "/v1/completions", p_body(), rid=rid)
    assert status == 200
    status, _ = await post(http, d, "/v1/completions", d_body(pr["kv_transfer_params"]), rid=rid)
    assert status == 200


async def keep_busy(http: aiohttp.ClientSession, eng: EngineHandle) -> asyncio.Task[Any]:
    """A long local decode on `eng`, so that its steps are decode steps, not idle ones."""
    body = {"model": "sim-model", "prompt": "busy", "max_tokens": 4000}
    task = asyncio.create_task(post(http, eng, "/v1/completions", body, rid="busy"))

    async def running() -> bool:
        return any(r["x_request_id"] == "busy" for r in await _records(http, eng))

    await eventually(running)
    return task


async def _records(http: aiohttp.ClientSession, eng: EngineHandle) -> list[dict[str, Any]]:
    async with http.get(eng.url + "/sim/requests") as resp:
        return list(await resp.json())


async def test_serial_push_waits_for_d_allocation_and_p_next_step(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        running_engine(*FAST, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        await serial_exchange(http, p, d, "warm-up")  # the once-per-pair handshakes
        await serial_exchange(http, p, d, "serial")
        pt, dt = await p_timeline(http, p, "serial"), await timeline(http, d, "serial")
    # P: the finished blocks reach the writer at the start of P's next step.
    assert step(pt, "blocks_to_writer") == step(pt, "finished") + 1
    # D: the registration leaves in the step that allocates the request, after P finished.
    assert step(dt, "push_reg_sent") == step(dt, "allocated")
    assert at(pt, "finished") < at(dt, "allocated") <= at(dt, "push_reg_sent")
    # P's writer matches it only then, and the WRITE follows the match.
    assert at(dt, "push_reg_sent") < at(pt, "push_reg_matched") <= at(pt, "write_started_serial")
    assert at(pt, "write_done") < at(dt, "write_done_received")
    # D: the writer forwards the completion at one step's end, the main thread counts it at
    # the next step's end, and the first token comes from the step after that.
    assert step(dt, "kv_seen") >= step(dt, "write_done_received") + 1
    assert step(dt, "first_token") == step(dt, "kv_seen") + 1


async def test_parallel_push_writes_one_p_step_after_the_finish(
    http: aiohttp.ClientSession,
) -> None:
    # prefill steps of ~100 ms, the warm-up's prompt not cached: "par" is computed again, so
    # that D registers while P still prefills it
    slow_prefill = (*FAST, "--prefill-per-token-ms", "2", "--no-enable-prefix-caching")
    async with (
        running_engine(*slow_prefill, "--kv-transfer-config", PUSH_P) as p,
        running_engine(*FAST, "--kv-transfer-config", PUSH_D) as d,
    ):
        await serial_exchange(http, p, d, "warm-up")
        p_leg = asyncio.create_task(post(http, p, "/v1/completions", p_body(), rid="par"))
        d_leg = asyncio.create_task(
            post(http, d, "/v1/completions", d_body(identity(p, "placeholder")), rid="par")
        )

        async def prefilling() -> bool:
            recs = [r for r in await _records(http, p) if r["x_request_id"] == "par"]
            return bool(recs) and any(e[0] == "allocated" for e in recs[0]["events"])

        await eventually(prefilling)  # the next request fills P's next step
        other = asyncio.create_task(post(http, p, "/v1/completions", p_body(), rid="other"))
        for leg in (p_leg, d_leg, other):
            assert (await leg)[0] == 200
        pt, dt = await p_timeline(http, p, "par"), await timeline(http, d, "par")
        nt = await timeline(http, p, "other")
    assert at(dt, "push_reg_sent") < at(pt, "finished")  # D registered during the prefill
    assert step(nt, "finished") == step(pt, "finished") + 1  # P's next step: another prefill
    # The blocks reach the writer as that step starts, and the WRITE starts then, while the
    # step runs: not in the finishing step, not after the next one.
    assert step(pt, "blocks_to_writer") == step(pt, "finished") + 1
    assert at(pt, "finished") <= at(pt, "blocks_to_writer") <= at(pt, "write_started_parallel")
    assert at(pt, "write_started_parallel") < at(nt, "finished")


async def penalty(http: aiohttp.ClientSession, step_ms: str) -> float:
    """D-side time to first token, serial push minus pull, while D is busy decoding."""
    flags = (*FAST, "--step-base-ms", step_ms)
    waits = {}
    for mode, (p_cfg, d_cfg) in {"push": (PUSH_P, PUSH_D), "pull": (PULL_P, PULL_D)}.items():
        async with (
            running_engine(*FAST, "--kv-transfer-config", p_cfg) as p,
            running_engine(*flags, "--kv-transfer-config", d_cfg) as d,
        ):
            busy = await keep_busy(http, d)
            try:
                samples = []
                for i in range(3):
                    rid = f"{mode}-{i}"
                    await serial_exchange(http, p, d, rid)
                    rec = await record(http, d, rid)
                    samples.append(rec["first_token_at"] - rec["received_at"])
                waits[mode] = sorted(samples)[1]
            finally:
                busy.cancel()
    return waits["push"] - waits["pull"]


async def test_serial_push_penalty_grows_with_step_time(http: aiohttp.ClientSession) -> None:
    short, long = await penalty(http, "5"), await penalty(http, "60")
    # Push adds a D step boundary that pull does not have (the writer forwards the completion,
    # the main thread counts it a step later): 5 ms there, 60 ms here.
    assert long > short + 0.03, (short, long)
