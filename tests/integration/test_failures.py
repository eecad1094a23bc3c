"""Failure coupling through Envoy: no request hangs when one leg fails."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import aiohttp
import orjson
import pytest

from tests.support.engines import MODEL, address
from tests.support.topology import (
    Topology,
    generated_text,
    identity_events,
    requests_total,
    topology,
)
from vllmsim.launcher import PUSH_D, PUSH_P, EngineHandle, running_engine

COMPLETION = {"model": MODEL, "prompt": "Once upon a time " * 20, "max_tokens": 8}


async def outcome_of(topo: Topology, engine: EngineHandle, request_id: str) -> str:
    for record in await topo.seen(engine):
        if record["x_request_id"] == request_id:
            return record["outcome"]
    raise AssertionError(f"{engine.url} never saw {request_id}")


async def wait_for_outcome(
    topo: Topology, engine: EngineHandle, request_id: str, expected: str
) -> None:
    """Engines notice a reset asynchronously; poll briefly (bounded) for it."""
    for _ in range(50):
        if await outcome_of(topo, engine, request_id) == expected:
            return
        await asyncio.sleep(0.05)
    assert await outcome_of(topo, engine, request_id) == expected


async def test_serial_dispatch_survives_a_prefill_slower_than_envoys_message_timeout() -> None:
    # Envoy's ext_proc message timeout is 1 s; a serial dispatch extends it while P computes.
    async with topology(dispatch={"probe": False}) as topo:
        await topo.sim(topo.prefills[0], "POST", "/sim/faults", {"latency_ms": 1500})
        started = time.perf_counter()
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        assert time.perf_counter() - started > 1.5


async def test_failed_prefill_in_parallel_mode_fails_fast_and_aborts_decode() -> None:
    async with topology() as topo:
        await topo.sim(
            topo.prefills[0],
            "POST",
            "/sim/faults",
            {"fail_next": 1, "fail_status": 500, "latency_ms": 300},
        )
        started = time.perf_counter()
        status, body, headers = await topo.post("/v1/completions", COMPLETION)
        elapsed = time.perf_counter() - started
        assert status == 502, body
        error = orjson.loads(body)["error"]
        assert error["code"] == 502 and "answered 500" in error["message"]
        assert headers.get("content-type") == "application/json", headers
        assert elapsed < 2.0
        [d_record] = await topo.seen(topo.decodes[0])
        await wait_for_outcome(topo, topo.decodes[0], d_record["x_request_id"], "aborted")
        metrics = await topo.metrics()
        assert metrics[requests_total("prefill_error", "cache_hit", "parallel")] == 1
        # dropped, whether or not a probe has learned it again since
        assert metrics.get(identity_events(address(topo.prefills[0]), "dropped")) == 1


async def test_prefill_4xx_is_passed_on_with_its_status() -> None:
    async with topology() as topo:
        await topo.sim(
            topo.prefills[0], "POST", "/sim/faults", {"fail_next": 1, "fail_status": 400}
        )
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 400, body


async def test_hanging_prefill_gives_504_after_the_prefill_timeout() -> None:
    async with topology(timeouts={"prefill_s": 1.0}) as topo:
        await topo.sim(topo.prefills[0], "POST", "/sim/faults", {"hang_next": 1})
        started = time.perf_counter()
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        elapsed = time.perf_counter() - started
        assert status == 504, body
        assert 0.9 < elapsed < 3.0
        [p_record] = await topo.seen(topo.prefills[0])
        await wait_for_outcome(topo, topo.prefills[0], p_record["x_request_id"], "aborted")
        await wait_for_outcome(topo, topo.decodes[0], p_record["x_request_id"], "aborted")


async def test_client_disconnect_cancels_both_legs_and_keeps_the_identity() -> None:
    async with topology() as topo:
        await topo.sim(topo.prefills[0], "POST", "/sim/faults", {"latency_ms": 2000})
        with contextlib.suppress(TimeoutError, aiohttp.ServerTimeoutError):
            await topo.post("/v1/completions", COMPLETION, timeout=0.5)
        [p_record] = await topo.seen(topo.prefills[0])
        await wait_for_outcome(topo, topo.prefills[0], p_record["x_request_id"], "aborted")
        await wait_for_outcome(topo, topo.decodes[0], p_record["x_request_id"], "aborted")
        ready = await topo.released()
        identity = ready["identities"][f"127.0.0.1:{topo.prefills[0].port}"]
        assert identity["engine_id"] == topo.prefills[0].engine_id
        for role in ("prefill", "decode"):
            assert all(e["in_flight"] == 0 for e in ready[role].values())


async def test_prefill_restart_under_a_request_gives_a_retryable_error_at_worst() -> None:
    # Health checks are slowed down so that the restart is first seen by a request.
    async with topology(dispatch={"probe": False}, health={"interval_s": 30}) as topo:
        status, _, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200
        new_state = await topo.sim(topo.prefills[0], "POST", "/sim/restart")
        assert new_state["engine_id"] != topo.prefills[0].engine_id
        started = time.perf_counter()
        status, body, headers = await topo.post("/v1/completions", COMPLETION)
        assert time.perf_counter() - started < 5
        # D was given the stale identity: the client gets a clear retryable error
        assert status == 503, body
        assert headers.get("retry-after") == "1"
        assert "restarted" in orjson.loads(body)["error"]["message"]
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        d_records = await topo.seen(topo.decodes[0])
        new_id = new_state["engine_id"]
        assert d_records[-1]["body"]["kv_transfer_params"]["remote_engine_id"] == new_id


PUSH_D_RECOMPUTE = PUSH_D[:-1] + ',"kv_load_failure_policy":"recompute"}'


@pytest.mark.parametrize("decode", [PUSH_D, PUSH_D_RECOMPUTE], ids=["fail", "recompute"])
async def test_streaming_request_just_after_a_prefill_restart_gets_503_before_any_200(
    decode: str,
) -> None:
    # A streaming D sends its 200 headers at once; they must not pass before P's answer shows
    # the restart. Health checks are slowed down so that each restart is first seen by the
    # request; a high flap threshold keeps the endpoint parallel across the restarts.
    config = {"dispatch": {"flap_threshold": 1000}, "health": {"interval_s": 30}}
    async with topology(connectors=(PUSH_P, decode), **config) as topo:
        stream = COMPLETION | {"stream": True}
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        for _ in range(3):
            await topo.sim(topo.prefills[0], "POST", "/sim/restart")
            status, body, headers = await topo.post("/v1/completions", stream, timeout=10)
            assert status == 503, body
            assert headers.get("retry-after") == "1"
            assert headers.get("content-type") == "application/json"
            error = orjson.loads(body)["error"]
            assert error["code"] == 503 and "restarted" in error["message"]
        status, body, _ = await topo.post("/v1/completions", stream, timeout=10)
        assert status == 200 and b'"error"' not in body and body.endswith(b"data: [DONE]\n\n")
        metrics = await topo.metrics()
        assert metrics[requests_total("identity_changed", "cache_hit", "parallel")] == 3


async def test_prefill_restart_is_detected_before_any_request() -> None:
    async with topology() as topo:  # health checks every 0.5 s, probes on
        prefill = f"127.0.0.1:{topo.prefills[0].port}"
        new_state = await topo.sim(topo.prefills[0], "POST", "/sim/restart")
        for _ in range(50):
            if (await topo.ready())["identities"][prefill]["engine_id"] == new_state["engine_id"]:
                break
            await asyncio.sleep(0.1)
        assert (await topo.ready())["identities"][prefill]["engine_id"] == new_state["engine_id"]
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        [(d_record)] = await topo.seen(topo.decodes[0])
        assert d_record["kv"] == "push-parallel"
        # the KV came from the restarted P, and it is right: the answer is the aggregated one
        assert d_record["kv_evidence"]["engine_ids"] == [new_state["engine_id"]]
        assert generated_text("/v1/completions", body) == await topo.aggregated(
            "/v1/completions", COMPLETION
        )
        metrics = await topo.metrics()
        assert metrics[identity_events(prefill, "restarted")] == 1


async def test_flapping_identity_makes_the_endpoint_serial_for_a_while() -> None:
    async with topology(dispatch={"probe": False}, health={"interval_s": 30}) as topo:
        prefill = f"127.0.0.1:{topo.prefills[0].port}"
        for _ in range(3):  # three engines behind one address within the window
            await topo.post("/v1/completions", COMPLETION)
            await topo.sim(topo.prefills[0], "POST", "/sim/restart")
        await topo.post("/v1/completions", COMPLETION)
        ready = await topo.ready()
        assert ready["identities"][prefill]["serial_only"] is True
        metrics = await topo.metrics()
        assert metrics[identity_events(prefill, "flapping")] >= 1
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        metrics = await topo.metrics()
        assert metrics[requests_total("ok", "serial_only", "serial")] >= 1


async def test_decode_failure_cancels_prefill_and_reaches_the_client() -> None:
    async with topology() as topo:
        await topo.sim(topo.prefills[0], "POST", "/sim/faults", {"latency_ms": 3000})
        await topo.sim(topo.decodes[0], "POST", "/sim/faults", {"fail_next": 1, "fail_status": 503})
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 503, body
        [p_record] = await topo.seen(topo.prefills[0])
        await wait_for_outcome(topo, topo.prefills[0], p_record["x_request_id"], "aborted")
        # the identity D was given is dropped: the next request learns it again
        metrics = await topo.metrics()
        assert metrics.get(identity_events(address(topo.prefills[0]), "dropped")) == 1


async def test_envoys_own_503_for_an_unreachable_decode_keeps_the_prefills_identity() -> None:
    """D never got the request, so its failure says nothing about P: the next request is still
    parallel (before, Envoy's own reply dropped P's identity like a failure of D's)."""
    async with topology(health={"interval_s": 30}) as topo:  # the sidecar keeps picking D
        prefill = address(topo.prefills[0])
        await topo.sim(
            topo.decodes[0], "POST", "/sim/faults", {"refuse_connections": True, "refuse_for_s": 30}
        )
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 503, body
        assert await topo.seen(topo.decodes[0]) == []  # Envoy's own reply: D was not reached
        await topo.sim(topo.decodes[0], "POST", "/sim/faults", {"refuse_connections": False})
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert status == 200, body
        metrics = await topo.metrics()
        assert metrics.get(identity_events(prefill, "dropped")) is None
        assert metrics[requests_total("ok", "cache_hit", "parallel")] == 1


async def test_decode_refusing_connections_is_replaced_by_envoys_retry_on_the_fallback() -> None:
    # Health checks are slowed down so that the sidecar still picks the refusing engine first.
    async with topology(n_decode=2, health={"interval_s": 30}) as topo:
        down, up = topo.decodes
        await topo.sim(
            down, "POST", "/sim/faults", {"refuse_connections": True, "refuse_for_s": 30}
        )
        for _ in range(4):  # round robin: two of them pick the refusing engine first
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
        assert (await topo.ready())["decode"][address(down)]["healthy"] is True
        # every request reached `up`, half of them as the fallback of the refusing engine
        lists = sorted(r["headers"]["x-gateway-destination-endpoint"] for r in await topo.seen(up))
        first_down, first_up = f"{address(down)},{address(up)}", f"{address(up)},{address(down)}"
        assert lists == sorted([first_down, first_down, first_up, first_up]), lists


async def test_a_request_served_by_the_fallback_decode_is_counted_there() -> None:
    async with topology(n_decode=2, health={"interval_s": 30}) as topo:
        down, up = topo.decodes
        await topo.sim(
            down, "POST", "/sim/faults", {"refuse_connections": True, "refuse_for_s": 30}
        )
        body = {**COMPLETION, "max_tokens": 2000, "stream": True}
        async with contextlib.AsyncExitStack() as held:
            for _ in range(2):  # round robin: one of them picks the refusing engine first
                response = await held.enter_async_context(
                    topo.session.post(topo.sidecar.url + "/v1/completions", json=body)
                )
                assert response.status == 200, await response.text()
                await asyncio.wait_for(response.content.readline(), 10)
            metrics = await topo.metrics()
            inflight = 'pd_extproc_inflight_requests{{endpoint="{}",role="decode"}}'
            assert metrics[inflight.format(address(up))] == 2  # both streams are there
            assert metrics[inflight.format(address(down))] == 0


async def test_unreachable_prefill_is_marked_down_and_skipped() -> None:
    async with topology(n_prefill=2) as topo:
        down = topo.prefills[0]
        await topo.sim(
            down, "POST", "/sim/faults", {"refuse_connections": True, "refuse_for_s": 30}
        )
        statuses = []
        for _ in range(6):
            status, _, _ = await topo.post("/v1/completions", COMPLETION)
            statuses.append(status)
        # at most one request is caught in flight (503, retryable); the rest go to the other P
        assert statuses.count(200) >= 5, statuses
        assert set(statuses) <= {200, 503}
        ready = await topo.ready()
        assert ready["prefill"][f"127.0.0.1:{down.port}"]["healthy"] is False


async def test_decode_that_never_gets_its_kv_is_bounded_by_the_kv_wait() -> None:
    async with topology(timeouts={"kv_wait_s": 1.5}) as topo:
        await topo.sim(topo.prefills[0], "POST", "/sim/faults", {"drop_registrations": True})
        started = time.perf_counter()
        status, body, _ = await topo.post("/v1/completions", COMPLETION)
        elapsed = time.perf_counter() - started
        assert status == 504, body
        assert orjson.loads(body)["error"]["code"] == 504  # Envoy's own reply, in JSON too
        assert 1.4 < elapsed < 4.0
        [d_record] = await topo.seen(topo.decodes[0])
        await wait_for_outcome(topo, topo.decodes[0], d_record["x_request_id"], "aborted")
        # a streaming client is cut off just as fast (its 200 has already gone out)
        started = time.perf_counter()
        with contextlib.suppress(aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            await topo.post("/v1/completions", COMPLETION | {"stream": True})
        assert time.perf_counter() - started < 4.0


async def test_client_disconnect_mid_stream_cancels_decode_and_keeps_identity() -> None:
    async with topology(engine_flags=("--step-base-ms", "50")) as topo:
        body = COMPLETION | {"stream": True, "max_tokens": 100}
        async with topo.session.post(topo.sidecar.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            await response.content.readline()  # the first event: the stream is running
        [(d_record)] = await topo.seen(topo.decodes[0])
        await wait_for_outcome(topo, topo.decodes[0], d_record["x_request_id"], "aborted")
        ready = await topo.released()
        prefill = f"127.0.0.1:{topo.prefills[0].port}"
        assert ready["identities"][prefill]["engine_id"] == topo.prefills[0].engine_id
        assert all(e["in_flight"] == 0 for e in ready["decode"].values())


async def wait_healthy(topo: Topology, role: str, endpoint: str, healthy: bool) -> None:
    for _ in range(100):
        if (await topo.ready())[role][endpoint]["healthy"] is healthy:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{role} {endpoint} never became healthy={healthy}")


async def test_prefill_down_at_start_up_is_used_once_it_comes_up() -> None:
    async with contextlib.AsyncExitStack() as stack:
        prefill_engine = await stack.enter_async_context(
            running_engine("--kv-transfer-config", PUSH_P)
        )
        async with (
            aiohttp.ClientSession() as session,
            session.post(prefill_engine.url + "/sim/restart", json={"down_for_s": 4}),
        ):
            pass  # the engine now refuses connections for 4 s, as if still starting
        async with topology(n_prefill=0, extra_prefills=[prefill_engine]) as topo:
            prefill = f"127.0.0.1:{prefill_engine.port}"
            assert (await topo.ready())["prefill"][prefill]["healthy"] is False
            await wait_healthy(topo, "prefill", prefill, True)
            for _ in range(300):  # re-probed once healthy (its probe may wait for a busy core)
                if (await topo.ready())["identities"].get(prefill, {}).get("engine_id"):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"{prefill} was never probed again once healthy")
            status, body, _ = await topo.post("/v1/completions", COMPLETION)
            assert status == 200, body
            [(d_record)] = await topo.seen(topo.decodes[0])
            assert d_record["kv"] == "push-parallel"
            state = await topo.sim(prefill_engine, "GET", "/sim/state")
            assert d_record["kv_evidence"]["engine_ids"] == [state["engine_id"]]


async def take_only_prefill_down(topo: Topology) -> None:
    """P refuses connections until the sidecar's health check has marked it down."""
    await topo.sim(
        topo.prefills[0], "POST", "/sim/faults", {"refuse_connections": True, "refuse_for_s": 30}
    )
    await wait_healthy(topo, "prefill", f"127.0.0.1:{topo.prefills[0].port}", False)


async def test_no_healthy_prefill_is_a_retryable_503_by_default() -> None:
    async with topology() as topo:
        await take_only_prefill_down(topo)
        status, body, headers = await topo.post("/v1/completions", COMPLETION)
        assert status == 503, body
        assert headers["retry-after"] == "1"
        assert await topo.seen(topo.decodes[0]) == []


async def test_no_healthy_prefill_can_fall_back_to_decode_only() -> None:
    async with topology(dispatch={"no_healthy_prefill": "decode_only"}) as topo:
        await take_only_prefill_down(topo)
        # The client's own params, with nothing of the router's to overwrite them here (keys
        # an engine serves anyway, so a leak shows in D's body), then under an escaped name.
        params = {"do_remote_prefill": False, "client_only": {"nested": [1, {"deeper": "x"}]}}
        plain = orjson.dumps(COMPLETION | {"kv_transfer_params": params})
        escaped = plain.replace(b'"kv_transfer_params"', b'"kv\\u005ftransfer_params"')
        for raw in (plain, escaped):
            status, body, _ = await topo.post("/v1/completions", raw)
            assert status == 200, body
        records = await topo.seen(topo.decodes[0])
        assert len(records) == 2
        for record in records:
            assert "kv_transfer_params" not in record["body"], record["body"]
        metrics = await topo.metrics()
        assert metrics[requests_total("ok", "no_prefill", "decode_only")] == 2


# A streaming answer whose P answered, but whose pushed KV never lands: D's 200 has passed and
# D waits in silence (vLLM has no timeout for it). The stream must end soon, not after
# timeouts.kv_wait_s (60 s here; the tests' bounds are far below it).
SILENT_BOUND_S = 8.0
LOST_KV = {"timeouts": {"kv_wait_s": 60}}


async def read_stream(topo: Topology, body: dict[str, object], bound_s: float) -> str:
    """How a streaming request ended: "ok" (whole), "error <status>" (JSON before any byte),
    "stream error" (D's error event inside its 200), "reset" (cut after its 200) or "silent"
    (a 200, then nothing within `bound_s`)."""
    url = topo.sidecar.url + "/v1/completions"
    try:
        async with asyncio.timeout(bound_s), topo.session.post(url, json=body) as response:
            if response.status != 200:
                error = orjson.loads(await response.read())["error"]
                assert error["code"] == response.status and error["message"], error
                return f"error {response.status}"
            text = await response.read()
            assert text.endswith(b"data: [DONE]\n\n"), text
            return "stream error" if b'data: {"error"' in text else "ok"
    except TimeoutError:
        return "silent"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
        return "reset"


async def stream_waiting_for_kv(topo: Topology) -> asyncio.Task[str]:
    """A streaming request whose 200 has passed and whose push P will never write."""
    await topo.sim(topo.prefills[0], "POST", "/sim/faults", {"drop_registrations": True})
    started = asyncio.create_task(
        read_stream(topo, COMPLETION | {"stream": True}, SILENT_BOUND_S + 2)
    )
    for _ in range(100):  # D waits for its KV once P has answered
        if any(r["outcome"] == "ok" for r in await topo.seen(topo.prefills[0])):
            return started
        await asyncio.sleep(0.05)
    raise AssertionError("P never answered")


@pytest.mark.parametrize("fault", ["restart", "down"])
async def test_a_stream_whose_prefill_is_lost_after_answering_is_ended_soon(fault: str) -> None:
    async with topology(**LOST_KV) as topo:
        stream = await stream_waiting_for_kv(topo)
        prefill = topo.prefills[0]
        started = time.perf_counter()
        if fault == "restart":  # a new engine: what the old one owed will never come
            await topo.sim(prefill, "POST", "/sim/restart")
        else:  # P stops answering (a crash): its health check fails
            await topo.sim(prefill, "POST", "/sim/faults", {"refuse_connections": True})
        assert await stream == "reset"
        assert time.perf_counter() - started < SILENT_BOUND_S
        metrics = await topo.metrics()
        assert metrics[requests_total("kv_lost", "cache_hit", "parallel")] == 1


async def test_a_burst_of_streams_across_a_prefill_restart_leaves_none_silent() -> None:
    # 1P2D push, streams in flight while P restarts just after its first answers: each ends
    # whole, with a JSON error before any byte, or reset; none stays silent after its 200.
    async with topology(n_decode=2, **LOST_KV) as topo:
        bodies = [COMPLETION | {"stream": True, "prompt": f"stream {i} " * 30} for i in range(100)]
        streams = [
            asyncio.create_task(read_stream(topo, body, SILENT_BOUND_S + 10)) for body in bodies
        ]
        for _ in range(200):  # restart once P has answered some of them
            if any(r["outcome"] == "ok" for r in await topo.seen(topo.prefills[0])):
                break
            await asyncio.sleep(0.01)
        await topo.sim(topo.prefills[0], "POST", "/sim/restart")
        ended = collections.Counter(await asyncio.gather(*streams))
        assert ended["silent"] == 0, ended


@pytest.mark.parametrize(
    ("fault", "status"),
    [
        ({"fail_next": 1, "fail_status": 500}, 502),
        ({"hang_next": 1}, 504),
        ({"refuse_connections": True}, 503),
    ],
    ids=["answers-500", "hangs", "refuses"],
)
async def test_a_prefill_failure_never_shows_the_client_an_engines_address(
    fault: dict[str, object], status: int
) -> None:
    # Slow health checks and no probe: the request is the first to meet the fault; serial
    # dispatch (no identity yet) has P's leg fail before anything reaches D.
    config = {"dispatch": {"probe": False}, "health": {"interval_s": 30}}
    async with topology(timeouts={"prefill_s": 1.0}, **config) as topo:
        await topo.sim(topo.prefills[0], "POST", "/sim/faults", fault)
        got, body, _ = await topo.post("/v1/completions", COMPLETION)
        assert got == status, body
        message = orjson.loads(body)["error"]["message"]
        assert "prefill engine" in message, message
        for secret in ("127.0.0.1", str(topo.prefills[0].port), "localhost"):
            assert secret not in body.decode(), body
        assert str(topo.prefills[0].port) in topo.sidecar.log_text()  # the operator's log has it
