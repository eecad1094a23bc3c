"""The sidecar's own metrics say what happened: in-flight counts, outcomes, series, buckets."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from extproc.testing import scrape
from tests.support.engines import MODEL, PULL, PUSH, address
from tests.support.polling import until
from tests.support.topology import Topology, topology

SLOW = ("--step-base-ms", "50")  # 1000 tokens: a stream open for ~50 s, far longer than a test
LONG = {"model": MODEL, "prompt": "Once upon a time " * 20, "max_tokens": 1000, "stream": True}
INFLIGHT = 'pd_extproc_inflight_requests{{endpoint="{}",role="{}"}}'


@contextlib.asynccontextmanager
async def streaming(topo: Topology) -> AsyncIterator[aiohttp.ClientResponse]:
    """A long generation, held open once its first event has arrived (so P has answered)."""
    async with topo.session.post(topo.sidecar.url + "/v1/completions", json=LONG) as response:
        assert response.status == 200, await response.text()
        await asyncio.wait_for(response.content.readline(), 10)
        yield response


async def inflight(topo: Topology, role: str) -> dict[str, float]:
    metrics = await scrape(topo.session, topo.sidecar.metrics + "/metrics")
    engines = topo.prefills if role == "prefill" else topo.decodes
    return {address(e): metrics.get(INFLIGHT.format(address(e), role), 0.0) for e in engines}


@pytest.mark.parametrize(
    ("connectors", "config"),
    [
        (PUSH, {}),  # parallel (the probe learnt P's identity)
        (PUSH, {"dispatch": {"probe": False}}),  # serial, cache_miss
        (PULL, {}),  # serial, pull
        (PUSH, {"dispatch": {"prefill_leg": "listener"}}),  # parallel, through Envoy
        (PULL, {"dispatch": {"prefill_leg": "listener"}}),  # serial, through Envoy
    ],
    ids=["parallel", "serial", "pull", "parallel-listener", "pull-listener"],
)
async def test_a_prefill_is_counted_in_flight_only_while_its_leg_runs(
    connectors: tuple[str, str], config: dict[str, Any]
) -> None:
    async with topology(connectors=connectors, engine_flags=SLOW, **config) as topo:
        await held_stream_releases_the_prefill(topo)


async def held_stream_releases_the_prefill(topo: Topology) -> None:
    """While a long generation streams (P answered long ago), P counts 0 and D counts 1."""

    async def prefill_released() -> bool:
        return set((await inflight(topo, "prefill")).values()) == {0.0}

    async with streaming(topo) as response:
        await until(prefill_released, "the prefills' in-flight counts to drop")
        assert list((await inflight(topo, "decode")).values()) == [1.0]
        assert not response.content.at_eof()


async def test_a_serial_retry_is_counted_at_the_fallback_while_it_runs_only() -> None:
    # the first prefill refuses connections: the P leg is retried on the other one
    config = {"dispatch": {"probe": False}, "health": {"interval_s": 30}}
    async with topology(n_prefill=2, engine_flags=SLOW, **config) as topo:
        down, up = topo.prefills
        await topo.sim(
            down, "POST", "/sim/faults", {"refuse_connections": True, "refuse_for_s": 30}
        )
        for _ in range(2):  # round robin: one of them picks the refusing engine first
            await held_stream_releases_the_prefill(topo)
        retries = (await topo.metrics())['pd_extproc_prefill_retries_total{reason="unreachable"}']
        assert retries == 1
        assert len(await topo.seen(up)) == 2


OUTCOMES = "pd_extproc_requests_total"
SHORT = {"model": MODEL, "prompt": "Once upon a time " * 20, "max_tokens": 8}
CUT = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)


@pytest_asyncio.fixture(scope="module")
async def logged() -> AsyncIterator[Topology]:
    """1P1D, D's KV wait short; Envoy's access-log stream to the sidecar already open (Envoy
    opens it at its first entry): from then on it decides the outcome of answers that start."""
    async with topology(timeouts={"kv_wait_s": 1.5}, engine_flags=("--step-base-ms", "20")) as topo:
        status, body, _ = await topo.post("/v1/completions", SHORT)
        assert status == 200, body

        async def entry_seen() -> bool:
            entries = 'pd_extproc_access_log_entries_total{result="observed"}'
            return (await topo.metrics()).get(entries, 0) >= 1

        await until(entry_seen, "the first access-log entry")
        yield topo


async def outcomes(topo: Topology) -> Counter[tuple[str, str, str, str]]:
    """pd_extproc_requests_total by (outcome, strategy, reason, model)."""
    counts: Counter[tuple[str, str, str, str]] = Counter()
    for key, value in (await topo.metrics()).items():
        name, _, rest = key.partition("{")
        if name == OUTCOMES:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
            key = (labels["outcome"], labels["strategy"], labels["reason"], labels["model"])
            counts[key] = int(value)
    return counts


@contextlib.asynccontextmanager
async def counting(topo: Topology) -> AsyncIterator[Counter[tuple[str, str, str, str]]]:
    """The requests counted while the block ran, by (outcome, strategy, reason, model)."""
    before = await outcomes(topo)
    counted: Counter[tuple[str, str, str, str]] = Counter()
    yield counted
    counted.update(await outcomes(topo))
    counted.subtract(before)
    for key in [k for k, v in counted.items() if v == 0]:
        del counted[key]


PARALLEL = ("parallel", "cache_hit", MODEL)


async def test_a_whole_answer_is_ok_and_one_the_client_left_is_cancelled(logged: Topology) -> None:
    async with counting(logged) as counted:
        status, body, _ = await logged.post("/v1/completions", SHORT | {"stream": True})
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert counted == {("ok", *PARALLEL): 1}
    async with counting(logged) as counted:
        body = SHORT | {"stream": True, "max_tokens": 500}
        async with logged.session.post(logged.sidecar.url + "/v1/completions", json=body) as r:
            await asyncio.wait_for(r.content.readline(), 10)  # then the client leaves
    assert counted == {("cancelled", *PARALLEL): 1}


async def test_a_stream_whose_kv_never_arrived_is_a_failure(logged: Topology) -> None:
    await logged.sim(logged.prefills[0], "POST", "/sim/faults", {"drop_registrations": True})
    try:
        async with counting(logged) as counted:
            with pytest.raises(CUT):  # its 200 went out at once; then Envoy cut the stream
                await logged.post("/v1/completions", SHORT | {"stream": True})
    finally:
        await logged.sim(logged.prefills[0], "POST", "/sim/faults", {"drop_registrations": False})
    assert counted == {("decode_timeout", *PARALLEL): 1}


async def test_engines_refusing_the_clients_request_count_as_client_errors(
    logged: Topology,
) -> None:
    cases = [
        SHORT | {"model": "no-such-model"},  # P refuses it first (404)
        SHORT | {"prompt": "hello " * 9000},  # over max_model_len for P too (400)
        SHORT | {"max_tokens": 9000},  # P (1 token) accepts it; D refuses it (400)
    ]
    async with counting(logged) as counted:
        for body in cases:
            status, answer, _ = await logged.post("/v1/completions", body)
            assert status in (400, 404), answer
    assert {outcome for outcome, *_ in counted} == {"client_error"}
    assert sum(counted.values()) == 3


async def test_a_decode_reset_mid_stream_is_a_failure(logged: Topology) -> None:
    body = SHORT | {"stream": True, "max_tokens": 500}
    url = logged.sidecar.url + "/v1/completions"
    async with counting(logged) as counted, logged.session.post(url, json=body) as r:
        assert r.status == 200
        await asyncio.wait_for(r.content.readline(), 10)
        await logged.sim(logged.decodes[0], "POST", "/sim/restart")  # D's process "dies"
        with pytest.raises(CUT):
            await r.read()
    assert counted == {("decode_reset", *PARALLEL): 1}
