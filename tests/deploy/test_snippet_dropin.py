"""The drop-in path end to end: `pd-extproc serve` plus an Envoy that is *not* rendered by
pd-extproc (its own listener, routes and a non-LLM route), into which only the output of
`render-envoy --snippet` is pasted. A completion must reach the engines as a parallel P/D pair.
Everything binds 127.0.0.1 with ephemeral ports; the prefill listener is a Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.cli import main as cli_main
from extproc.envoy_process import EnvoyProcess
from extproc.testing import scrape
from vllmsim.testing import FAST, PUSH_D, PUSH_P, EngineHandle, running_engine

_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HCM = ("type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager")  # fmt: skip
_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
COMPLETION = {"model": "sim-model", "prompt": "hello " * 50, "max_tokens": 4}


@contextlib.asynccontextmanager
async def serving(config: Path, prefill_listener: str, log: Path) -> AsyncIterator[str]:
    """`pd-extproc serve`; yields the ext_proc's host:port once it printed it."""
    with log.open("wb") as log_file:  # the child keeps its own descriptor
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "serve", "--config", str(config),
            "--prefill-listener", prefill_listener,
            stdout=asyncio.subprocess.PIPE, stderr=log_file, start_new_session=True,
        )  # fmt: skip
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        match = re.search(r"ext_proc on (\S+:\d+)", line.decode())
        if match is None:
            tail = await asyncio.to_thread(log.read_text)
            raise AssertionError(f"pd-extproc serve did not start: {line!r}\n{tail[-2000:]}")
        yield match.group(1)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()


def snippet(config: Path, extproc: str, prefill_listener: str) -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["render-envoy", "--config", str(config), "--snippet",
                         "--extproc-address", extproc,
                         "--prefill-listener", prefill_listener]) == 0  # fmt: skip
    return yaml.safe_load(out.getvalue())


def users_envoy(pieces: dict[str, Any]) -> dict[str, Any]:
    """Somebody's existing Envoy, with the snippet pasted where its header says."""
    routes = [
        {"match": {"path": "/v1/completions"},
         "route": {"cluster": "decode_pool", "timeout": "0s",
                   "retry_policy": {"retry_on": "connect-failure", "num_retries": 1}},
         "request_body_buffer_limit": 1 << 20},
        {"match": {"prefix": "/"},
         "direct_response": {"status": 200, "body": {"inline_string": "my other service"}},
         "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
             "@type": _PER_ROUTE, "disabled": True}}},
    ]  # fmt: skip
    hcm = {
        "@type": _HCM,
        **pieces["http_connection_manager"],
        "stat_prefix": "my_ingress",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [*pieces["http_filters"],
                         {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }  # fmt: skip
    ingress = {
        "name": "my_ingress",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }  # fmt: skip
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [ingress, *pieces["listeners"]],
            "clusters": pieces["clusters"],
        },
    }


def address(engine: EngineHandle) -> str:
    return f"127.0.0.1:{engine.port}"


async def requests_seen(session: aiohttp.ClientSession, engine: EngineHandle) -> list[dict]:
    async with session.get(engine.url + "/sim/requests") as response:
        records = await response.json()
    return [r for r in records if not (r["x_request_id"] or "").startswith("pd-extproc-probe-")]


async def sidecar_metrics(session: aiohttp.ClientSession, log: Path) -> dict[str, float]:
    """`serve` logs where its metrics are; port 0 in the config makes them ephemeral."""
    match = re.search(r"metrics on (\S+)", await asyncio.to_thread(log.read_text))
    assert match, "pd-extproc serve did not log its metrics address"
    return await scrape(session, f"http://{match.group(1)}/metrics")


@pytest.mark.timeout(120)
async def test_snippet_in_an_existing_envoy_dispatches_in_parallel(tmp_path: Path) -> None:
    sock = f"unix:{tmp_path}/prefill.sock"
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_P, *FAST))
        d = await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_D, *FAST))
        config = tmp_path / "pd-extproc.yaml"
        config.write_text(yaml.safe_dump({
            "prefill": {"endpoints": [address(p)]}, "decode": {"endpoints": [address(d)]},
            "extproc": {"host": "127.0.0.1", "port": 0}, "metrics": {"port": 0},
            "health": {"interval_s": 0.5, "timeout_s": 0.5},
        }))  # fmt: skip
        extproc = await stack.enter_async_context(serving(config, sock, tmp_path / "serve.log"))
        bootstrap = tmp_path / "envoy.yaml"
        bootstrap.write_text(yaml.safe_dump(users_envoy(snippet(config, extproc, sock))))
        envoy = EnvoyProcess(bootstrap, tmp_path, "warning", 1)
        await envoy.start()
        stack.push_async_callback(envoy.stop)
        url = "http://" + await envoy.listener_address("my_ingress")
        session = await stack.enter_async_context(aiohttp.ClientSession())
        timeout = aiohttp.ClientTimeout(total=20)
        async with session.get(url + "/other", timeout=timeout) as response:
            assert await response.text() == "my other service"  # untouched by the ext_proc
        statuses = []
        for _ in range(3):
            async with session.post(url + "/v1/completions", json=COMPLETION,
                                    timeout=timeout) as response:  # fmt: skip
                statuses.append((response.status, await response.text()))
        assert all(status == 200 for status, _ in statuses), statuses
        prefill_ids = {r["x_request_id"] for r in await requests_seen(session, p)}
        decoded = await requests_seen(session, d)
        assert len(decoded) == 3 and {r["x_request_id"] for r in decoded} == prefill_ids
        # the sidecar's own count: whether D's KV *arrived* in parallel depends on timing
        metrics = await sidecar_metrics(session, tmp_path / "serve.log")
        parallel = 'pd_extproc_requests_total{outcome="ok",reason="cache_hit",strategy="parallel"}'
        assert metrics.get(parallel, 0) >= 1, metrics
