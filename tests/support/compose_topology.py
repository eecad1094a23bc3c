"""docker-compose.yml's topology as plain processes: 2 prefill + 2 decode vllmsim engines and
the sidecar (Envoy + ext_proc) on ephemeral loopback ports; the dashboard it is checked against."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from extproc.testing import SidecarHandle, ephemeral_config, running_sidecar
from tests.support.deploy import ROOT
from tests.support.engines import address
from vllmsim.launcher import FAST, PUSH_D, PUSH_P, EngineHandle, running_engine

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pd-extproc.json"


COMPLETION = {"model": "sim-model", "prompt": "The quick brown fox " * 20, "max_tokens": 4}


TIMEOUT = aiohttp.ClientTimeout(total=10)


@dataclass
class Topology:
    prefills: list[EngineHandle]
    decodes: list[EngineHandle]
    sidecar: SidecarHandle


@contextlib.asynccontextmanager
async def compose_topology(**extra: Any) -> AsyncIterator[Topology]:
    """`extra`: config sections for the sidecar (`ephemeral_config`)."""
    async with contextlib.AsyncExitStack() as stack:
        prefills = [
            await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_P, *FAST))
            for _ in range(2)
        ]
        decodes = [
            await stack.enter_async_context(running_engine("--kv-transfer-config", PUSH_D, *FAST))
            for _ in range(2)
        ]
        config = ephemeral_config(
            [address(e) for e in prefills], [address(e) for e in decodes], **extra
        )
        sidecar = await stack.enter_async_context(running_sidecar(config))
        yield Topology(prefills, decodes, sidecar)
