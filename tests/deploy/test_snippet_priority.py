"""The priority header of docs/dispatch-and-failures.md in somebody's own Envoy: removed from the
client's request by the HCM's early header mutation and set again by a filter before the
ext_proc, the gateway's value is the one admission control uses; a route's
`request_headers_to_remove` instead leaves the client's value for the ext_proc to read."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.process.envoy_process import EnvoyProcess
from tests.support.engines import address
from tests.support.snippet import render, serving, users_envoy
from vllmsim.launcher import PUSH_D, PUSH_P, running_engine

HEADER = "x-gateway-priority"
SHORT = {"model": "sim-model", "prompt": "hello " * 10, "max_tokens": 2}
HELD = {"model": "sim-model", "prompt": "Keep going", "max_tokens": 2000, "stream": True}
_HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3"
_EARLY_MUTATION = (
    "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3"
)


def _hcm(envoy: dict[str, Any]) -> dict[str, Any]:
    [ingress] = [x for x in envoy["static_resources"]["listeners"] if x["name"] == "ingress"]
    hcm: dict[str, Any] = ingress["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def documented(pieces: dict[str, Any]) -> dict[str, Any]:
    """The client's header removed before any filter; the gateway marks everything -3."""
    envoy = users_envoy(pieces)
    hcm = _hcm(envoy)
    hcm["early_header_mutation_extensions"] = [
        {
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _EARLY_MUTATION + ".HeaderMutation",
                "mutations": [{"remove": HEADER}],
            },
        }
    ]
    setter = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _HEADER_MUTATION + ".HeaderMutation",
            "mutations": {
                "request_mutations": [
                    {
                        "append": {
                            "header": {"key": HEADER, "value": "-3"},
                            "append_action": "ADD_IF_ABSENT",
                        }
                    }
                ]
            },
        },
    }
    hcm["http_filters"].insert(0, setter)
    return envoy


def route_removal(pieces: dict[str, Any]) -> dict[str, Any]:
    """The header removed by the routes instead: the router does that after the ext_proc."""
    envoy = users_envoy(pieces)
    for route in _hcm(envoy)["route_config"]["virtual_hosts"][0]["routes"]:
        route.setdefault("request_headers_to_remove", []).append(HEADER)
    return envoy


def written(tmp: Path, config: dict[str, Any]) -> Path:
    tmp.mkdir()
    bootstrap = tmp / "envoy.yaml"
    bootstrap.write_text(yaml.safe_dump(config))
    return bootstrap


async def started(stack: contextlib.AsyncExitStack, bootstrap: Path) -> str:
    envoy = EnvoyProcess(bootstrap, bootstrap.parent, "warning", 1)
    await envoy.start()
    stack.push_async_callback(envoy.stop)
    return "http://" + await envoy.listener_address("ingress")


@pytest.mark.timeout(120)
async def test_only_the_gateways_priority_reaches_admission(tmp_path: Path) -> None:
    sock = f"unix:{tmp_path}/prefill.sock"
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_P))
        d = await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_D))
        config = tmp_path / "pd-extproc.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "prefill": {"endpoints": [address(p)]},
                    "decode": {"endpoints": [address(d)]},
                    "extproc": {"host": "127.0.0.1", "port": 0},
                    "metrics": {"port": 0},
                    "health": {"interval_s": 0.5, "timeout_s": 0.5},
                    "admission": {
                        "enabled": True,
                        "decode": {"max_in_flight": 4},
                        "priority_header": HEADER,
                    },
                }
            )
        )
        extproc = await stack.enter_async_context(serving(config, sock, tmp_path / "serve.log"))
        pieces = render(config, extproc, sock, "--snippet")
        gateway = await started(stack, written(tmp_path / "documented", documented(pieces)))
        too_late = await started(stack, written(tmp_path / "route", route_removal(pieces)))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        timeout = aiohttp.ClientTimeout(total=20)

        async def status(url: str, priority: str) -> int:
            async with session.post(
                url + "/v1/completions", json=SHORT, headers={HEADER: priority}, timeout=timeout
            ) as response:
                return response.status

        assert await status(gateway, "0") == 200  # idle: even -3 is admitted
        held = await stack.enter_async_context(
            session.post(gateway + "/v1/completions", json=HELD, timeout=timeout)
        )
        assert held.status == 200
        await held.content.readline()  # in flight: 1 of 4, where -3 is shed (25 %)
        assert await status(gateway, "0") == 429  # the gateway's -3, not the client's 0
        assert await status(too_late, "0") == 200  # the client's own value ...
        assert await status(too_late, "-3") == 429  # ... reached the ext_proc
