"""`pd-extproc serve` as a process, and the snippet it renders pasted into somebody's own Envoy."""

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

import yaml

from extproc.cli import main as cli_main

_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HCM = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
    ".HttpConnectionManager"
)


@contextlib.asynccontextmanager
async def serving(config: Path, prefill_listener: str, log: Path) -> AsyncIterator[str]:
    """`pd-extproc serve`; yields the ext_proc's host:port once it printed it."""
    async with serving_process(config, prefill_listener, log) as (address, _):
        yield address


@contextlib.asynccontextmanager
async def serving_process(
    config: Path, prefill_listener: str, log: Path
) -> AsyncIterator[tuple[str, int]]:
    """`pd-extproc serve`; yields its host:port once it printed it, and its pid."""
    with log.open("wb") as log_file:  # the child keeps its own descriptor
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "extproc",
            "serve",
            "--config",
            str(config),
            "--prefill-listener",
            prefill_listener,
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
            start_new_session=True,
        )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        match = re.search(r"ext_proc on ([^\s,]+)", line.decode())  # host:port or unix:path
        if match is None:
            tail = await asyncio.to_thread(log.read_text)
            raise AssertionError(f"pd-extproc serve did not start: {line!r}\n{tail[-2000:]}")
        yield match.group(1), process.pid
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)
                await process.wait()


def render(config: Path, extproc: str, prefill_listener: str, *flags: str) -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert (
            cli_main(
                [
                    "render-envoy",
                    "--config",
                    str(config),
                    *flags,
                    "--extproc-address",
                    extproc,
                    "--prefill-listener",
                    prefill_listener,
                ]
            )
            == 0
        )
    return yaml.safe_load(out.getvalue())


def users_envoy(pieces: dict[str, Any]) -> dict[str, Any]:
    """Somebody's existing Envoy, with the snippet pasted where its header says."""
    mine = {
        "match": {"prefix": "/"},
        "direct_response": {"status": 200, "body": {"inline_string": "my other service"}},
        **pieces["every_other_route"],
    }
    hcm = {
        "@type": _HCM,
        **pieces["http_connection_manager"],
        "stat_prefix": "my_ingress",
        "route_config": {
            "virtual_hosts": [
                {"name": "all", "domains": ["*"], "routes": [*pieces["routes"], mine]}
            ]
        },
        "http_filters": [
            *pieces["http_filters"],
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }
    ingress = {
        "name": "ingress",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }
    return {
        "node": pieces["node"],
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [ingress, *pieces["listeners"]],
            "clusters": pieces["clusters"],
        },
    }
