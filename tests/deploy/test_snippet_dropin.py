"""The drop-in path end to end: `pd-extproc serve` plus an Envoy that is *not* rendered by
pd-extproc (its own listener and a route of its own), into which only the output of
`render-envoy --snippet` is pasted, checked exactly like the complete rendered bootstrap:
routing (a parallel P/D pair; the user's own route untouched), a client's destination header and
path tricks (never steer anything past the ext_proc) and the KV-wait bound (a decode waiting for
KV that never comes gets 504). Everything binds 127.0.0.1 with ephemeral ports; the prefill
listener is a Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from extproc.headers import DESTINATION_HEADER
from extproc.process.envoy_process import EnvoyProcess
from extproc.testing import fixed_routing, scrape
from tests.support.engines import address, engine_requests
from tests.support.snippet import render, serving, users_envoy
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, running_engine

COMPLETION = {"model": "sim-model", "prompt": "hello " * 50, "max_tokens": 4}


def rendered_envoy(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The complete bootstrap, its ingress on an ephemeral port."""
    for listener in bootstrap["static_resources"]["listeners"]:
        if listener["name"] == "ingress":
            listener["address"]["socket_address"]["port_value"] = 0
    return bootstrap


async def sidecar_metrics(session: aiohttp.ClientSession, log: Path) -> dict[str, float]:
    """`serve` logs where its metrics are; port 0 in the config makes them ephemeral."""
    match = re.search(r"metrics on (\S+)", await asyncio.to_thread(log.read_text))
    assert match, "pd-extproc serve did not log its metrics address"
    return await scrape(session, f"http://{match.group(1)}/metrics")


async def raw_post(url: str, target: bytes, body: bytes) -> int:
    """One request written byte for byte (clients normalise targets themselves)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST " + target + b" HTTP/1.1\r\nhost: pd\r\nconnection: close\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
        )
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return int(response.split(b" ", 2)[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("envoy_kind", ["snippet", "bootstrap"])
async def test_drop_in_behaves_like_the_rendered_bootstrap(tmp_path: Path, envoy_kind: str) -> None:
    sock = f"unix:{tmp_path}/prefill.sock"
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_P, *FAST))
        d = await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_D, *FAST))
        config = tmp_path / "pd-extproc.yaml"
        config.write_text(
            yaml.safe_dump(
                fixed_routing(
                    {
                        "prefill": {"endpoints": [address(p)]},
                        "decode": {"endpoints": [address(d)]},
                        "extproc": {"host": "127.0.0.1", "port": 0},
                        "metrics": {"port": 0},
                        "health": {"interval_s": 0.5, "timeout_s": 0.5},
                        "timeouts": {"kv_wait_s": 1.5},
                    }
                )
            )
        )
        extproc = await stack.enter_async_context(serving(config, sock, tmp_path / "serve.log"))
        if envoy_kind == "snippet":
            envoy_config = users_envoy(render(config, extproc, sock, "--snippet"))
        else:
            envoy_config = rendered_envoy(render(config, extproc, sock))
        bootstrap = tmp_path / "envoy.yaml"
        bootstrap.write_text(yaml.safe_dump(envoy_config))
        envoy = EnvoyProcess(bootstrap, tmp_path, "warning", 1)
        await envoy.start()
        stack.push_async_callback(envoy.stop)
        url = "http://" + await envoy.listener_address("ingress")
        session = await stack.enter_async_context(aiohttp.ClientSession())
        timeout = aiohttp.ClientTimeout(total=20)

        # routing: the OpenAI paths as parallel P/D pairs; anything else as the Envoy says
        async with session.get(url + "/other", timeout=timeout) as response:
            if envoy_kind == "snippet":  # the user's own route, untouched by the ext_proc
                assert await response.text() == "my other service"
            else:  # the bootstrap's catch-all goes through the ext_proc: JSON 404
                assert response.status == 404
        statuses = []
        for _ in range(3):
            async with session.post(
                url + "/v1/completions",
                json=COMPLETION,
                headers={DESTINATION_HEADER: "203.0.113.9:80"},
                timeout=timeout,
            ) as response:
                statuses.append((response.status, await response.text()))
        assert all(status == 200 for status, _ in statuses), statuses
        prefill_ids = {r["x_request_id"] for r in await engine_requests(session, p)}
        decoded = await engine_requests(session, d)
        assert len(decoded) == 3 and {r["x_request_id"] for r in decoded} == prefill_ids
        for record in decoded:  # the client's destination header never reaches an engine
            assert "203.0.113.9" not in record["headers"].get(DESTINATION_HEADER, "")
        metrics = await sidecar_metrics(session, tmp_path / "serve.log")
        parallel = (
            'pd_extproc_requests_total{model="sim-model",outcome="ok",reason="cache_hit",'
            'strategy="parallel"}'
        )
        assert metrics.get(parallel, 0) >= 1, metrics

        # path tricks: no spelling of an OpenAI path dodges the ext_proc
        evil = orjson.dumps(COMPLETION | {"kv_transfer_params": {"remote_engine_id": "evil"}})
        for target in (
            b"/health/../v1/completions",
            b"/v1/models%2F..%2Fcompletions",
            b"//v1//completions",
            b"/v1/models/%2e%2e/completions",
        ):
            await raw_post(url, target, evil)
        for engine in (p, d):
            seen = orjson.dumps(await engine_requests(session, engine))
            assert b"evil" not in seen, envoy_kind

        # the KV-wait bound: a decode whose KV never comes gets Envoy's JSON 504
        async with session.post(p.url + "/sim/faults", json={"drop_registrations": True}):
            pass
        started = time.perf_counter()
        async with session.post(
            url + "/v1/completions", json=COMPLETION, timeout=timeout
        ) as response:
            status, body = response.status, await response.read()
        assert status == 504, body
        assert orjson.loads(body)["error"]["code"] == 504
        assert 1.4 < time.perf_counter() - started < 6.0
