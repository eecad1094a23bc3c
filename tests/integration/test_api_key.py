"""Engines started with --api-key, through the real Envoy and ext_proc: the client's key
reaches both legs, a request without it gets the engines' 401 at once, and the identity probe
uses the key from `engines.api_key_file` (or says in one line that it needs one). Where the P
leg carries the sidecar's key instead of the client's, the ext_proc checks the client's key
itself, before any leg leaves."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio

from tests.support.engines import MODEL, PULL, PUSH, address
from tests.support.legs import legs
from tests.support.topology import Topology, requests_total, topology

KEY = "sk-pd-test-7d1c"
# Default step times: with FAST ones P finishes before D asks, and vllmsim calls that serial.
ENGINE_FLAGS = ("--api-key", KEY)
COMPLETION = {"model": MODEL, "prompt": "keyed " * 20, "max_tokens": 4}
AUTHORIZED = {"Authorization": f"Bearer {KEY}"}


@contextlib.asynccontextmanager
async def keyed_topology(keys: str = KEY + "\n", **config: Any) -> AsyncIterator[Topology]:
    with tempfile.TemporaryDirectory(prefix="pd-key-") as tmp:
        key_file = Path(tmp) / "engine-key"
        key_file.write_text(keys)
        async with topology(
            engine_flags=ENGINE_FLAGS, engines={"api_key_file": str(key_file)}, **config
        ) as topo:
            yield topo


@pytest_asyncio.fixture(scope="module")
async def keyed() -> AsyncIterator[Topology]:
    async with keyed_topology() as topo:
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


NOT_FORWARDED = {"forward_headers": ["traceparent", "tracestate"]}  # P gets the sidecar's key


@pytest.mark.parametrize(("mode", "connectors"), [("push", PUSH), ("pull", PULL)])
async def test_a_client_without_the_key_starts_no_leg_where_p_gets_the_sidecars_key(
    mode: str, connectors: tuple[str, str]
) -> None:
    dispatch = NOT_FORWARDED | {"mode": mode}
    async with keyed_topology(connectors=connectors, dispatch=dispatch) as topo:
        await topo.clear()
        refused = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY})
        answers = []
        for stream in (False, True):
            for headers in refused:
                body = COMPLETION | {"stream": stream}
                answers.append(
                    await asyncio.wait_for(
                        topo.post("/v1/completions", body, headers=headers, timeout=10), 10
                    )
                )
        assert [status for status, _, _ in answers] == [401] * 6, answers
        for engine in topo.engines:
            assert await topo.seen(engine) == []  # no P computed, no D asked
        for _, payload, response_headers in answers:
            assert response_headers["content-type"] == "application/json"
            error = orjson.loads(payload)["error"]
            assert error["code"] == 401 and error["type"] == "AuthenticationError"
            assert error["message"].startswith("Unauthorized")
        metrics = await topo.metrics()
        assert metrics[requests_total("client_error", "none", "none", model="none")] == 6
        # the key, with vLLM's case-insensitive scheme: P gets the sidecar's, D the client's
        status, body, _ = await topo.post(
            "/v1/completions", COMPLETION, headers={"Authorization": f"bearer {KEY}"}
        )
        assert status == 200, body
        [(p, d)] = await legs(topo)
        assert p["headers"]["authorization"] == f"Bearer {KEY}"
        assert d["headers"]["authorization"] == f"bearer {KEY}"


@pytest.mark.parametrize("prefill_leg", ["direct", "listener"])
async def test_every_key_of_the_engines_is_accepted_and_the_first_is_the_sidecars(
    prefill_leg: str,
) -> None:
    """Both P-leg paths carry the sidecar's key: straight to the engine, and through Envoy's
    prefill listener (which passes the ext_proc's headers on to P)."""
    second = "sk-pd-second-91ab"
    flags = ("--api-key", KEY, second)
    with tempfile.TemporaryDirectory(prefix="pd-key-") as tmp:
        key_file = Path(tmp) / "engine-key"
        key_file.write_text(f"{KEY}\n{second}\n")
        async with topology(
            engine_flags=flags,
            engines={"api_key_file": str(key_file)},
            dispatch=NOT_FORWARDED | {"prefill_leg": prefill_leg},
        ) as topo:
            await topo.clear()
            for stream in (False, True):
                status, body, _ = await topo.post(
                    "/v1/completions",
                    COMPLETION | {"stream": stream},
                    headers={"Authorization": f"Bearer {second}"},
                )
                assert status == 200, body
            pairs = await legs(topo)
            assert len(pairs) == 2, pairs
            for p, d in pairs:
                assert p is not None and p["status"] == 200, p
                assert p["headers"]["authorization"] == f"Bearer {KEY}"
                assert d["headers"]["authorization"] == f"Bearer {second}"
