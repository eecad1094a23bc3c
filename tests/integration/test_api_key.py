"""Engines started with --api-key, through the real Envoy and ext_proc: the client's key
reaches both legs, a request without it gets the engines' 401 at once, and the identity probe
uses the key from `engines.api_key_file` (or says in one line that it needs one)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest_asyncio

from tests.support.engines import MODEL, address
from tests.support.legs import legs
from tests.support.topology import Topology, requests_total, topology

KEY = "sk-pd-test-7d1c"
# Default step times: with FAST ones P finishes before D asks, and vllmsim calls that serial.
ENGINE_FLAGS = ("--api-key", KEY)
COMPLETION = {"model": MODEL, "prompt": "keyed " * 20, "max_tokens": 4}
AUTHORIZED = {"Authorization": f"Bearer {KEY}"}


@pytest_asyncio.fixture(scope="module")
async def keyed() -> AsyncIterator[Topology]:
    with tempfile.TemporaryDirectory(prefix="pd-key-") as tmp:
        key_file = Path(tmp) / "engine-key"
        key_file.write_text(KEY + "\n")
        async with topology(
            engine_flags=ENGINE_FLAGS, engines={"api_key_file": str(key_file)}
        ) as topo:
            yield topo


async def test_the_probe_uses_the_configured_key(keyed: Topology) -> None:
    identities = (await keyed.ready())["identities"]
    assert address(keyed.prefills[0]) in identities, identities


async def test_the_clients_key_reaches_both_legs_and_it_is_served_in_parallel(
    keyed: Topology,
) -> None:
    await keyed.clear()
    before = (await keyed.metrics()).get(requests_total("ok", "cache_hit", "parallel"), 0)
    headers = AUTHORIZED | {
        "traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01",
        "x-not-forwarded": "1",
    }
    status, body, _ = await keyed.post("/v1/completions", COMPLETION, headers=headers)
    assert status == 200, body
    [(p, d)] = await legs(keyed)
    assert d["kv"] == "push-parallel"
    assert p["headers"]["authorization"] == d["headers"]["authorization"] == f"Bearer {KEY}"
    assert p["headers"]["traceparent"] == headers["traceparent"]
    assert "x-not-forwarded" not in p["headers"] and "x-not-forwarded" in d["headers"]
    after = (await keyed.metrics())[requests_total("ok", "cache_hit", "parallel")]
    assert after == before + 1


async def test_without_the_key_the_client_gets_the_engines_401(keyed: Topology) -> None:
    await keyed.clear()
    for stream in (False, True):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            body = COMPLETION | {"stream": stream}
            status, payload, response_headers = await asyncio.wait_for(
                keyed.post("/v1/completions", body, headers=headers, timeout=10), 10
            )
            assert status == 401, payload
            assert response_headers["content-type"] == "application/json"
            assert "Unauthorized" in orjson.dumps(orjson.loads(payload)).decode()
    for engine in keyed.engines:
        assert await keyed.seen(engine) == []  # refused before any engine work
    # P's 401 is about the request, not P: its identity stays and the next request is parallel
    assert address(keyed.prefills[0]) in (await keyed.ready())["identities"]
    parallel = requests_total("ok", "cache_hit", "parallel")
    before = (await keyed.metrics()).get(parallel, 0)
    status, body, _ = await keyed.post("/v1/completions", COMPLETION, headers=AUTHORIZED)
    assert status == 200, body
    assert (await keyed.metrics()).get(parallel, 0) == before + 1


async def test_a_probe_without_a_key_says_so_once() -> None:
    async with topology(engine_flags=ENGINE_FLAGS) as topo:
        endpoint = address(topo.prefills[0])
        failed = f'pd_extproc_identity_probes_total{{endpoint="{endpoint}",outcome="failed"}}'
        for _ in range(100):  # the probe repeats every health round (0.5 s here)
            if (await topo.metrics()).get(failed, 0) >= 3:
                break
            await asyncio.sleep(0.1)
        lines = [line for line in topo.sidecar.log_text().splitlines() if "probe" in line]
        assert len(lines) == 1, lines
        assert "requires an API key (401); set engines.api_key_file" in lines[0]
        # it still serves: the first request runs serially and teaches P's identity
        for _ in range(2):
            status, body, _ = await topo.post("/v1/completions", COMPLETION, headers=AUTHORIZED)
            assert status == 200, body
        metrics = await topo.metrics()
        assert metrics[requests_total("ok", "cache_miss", "serial")] == 1
        assert metrics[requests_total("ok", "cache_hit", "parallel")] == 1
