"""pd-extproc as the endpoint picker (`pd-extproc epp`) of vllmsim engines, behind an Envoy
configured as a GIE gateway (tests/support/gateway.py); processes on ephemeral loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from multidict import CIMultiDict

from extproc.process.subprocesses import terminate
from extproc.testing import fixed_routing
from tests.support.engines import (
    MODEL,
    PUSH,
    address,
    clear_engines,
    engine_requests,
    start_engines,
)
from tests.support.gateway import Variant, running_gateway
from vllmsim.launcher import EngineHandle

__all__ = ["MODEL", "GatewayTopology", "Picker", "epp_config", "epp_topology", "running_epp"]


@dataclass(frozen=True)
class Picker:
    """A running `pd-extproc epp` process."""

    extproc: str
    metrics: str
    health_port: int
    log_path: Path
    pid: int

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def epp_config(prefills: list[Any], decodes: list[Any], **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "prefill": {"endpoints": prefills},
        "decode": {"endpoints": decodes},
        "extproc": {"port": 0},
        "metrics": {"port": 0, "ready_detail": True},  # tests read /ready?verbose
        "endpoint_picker": {"health_port": 0},
        # checked often, but a scrape late on a loaded 2-core machine is not an outage (a P
        # marked down forgets its identity: its requests then went serial, failing the tests
        # that expect push-parallel); no test here hangs an engine
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
    }
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return fixed_routing(config)


async def _ready(path: Path, process: asyncio.subprocess.Process, log: Path) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + 60
    while asyncio.get_running_loop().time() < deadline:
        if process.returncode is not None:
            break
        if await asyncio.to_thread(path.exists):
            info: dict[str, Any] = orjson.loads(await asyncio.to_thread(path.read_bytes))
            return info
        await asyncio.sleep(0.05)
    text = await asyncio.to_thread(log.read_text)
    raise RuntimeError(f"pd-extproc epp did not start ({process.returncode}):\n{text[-3000:]}")


@contextlib.asynccontextmanager
async def running_epp(config: dict[str, Any]) -> AsyncIterator[Picker]:
    with tempfile.TemporaryDirectory(prefix="pd-extproc-epp-") as tmp:
        config_path, ready, log_path = (Path(tmp) / n for n in ("c.yaml", "ready", "epp.log"))
        config_path.write_text(yaml.safe_dump(config))
        with log_path.open("wb") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "extproc",
                "epp",
                "--config",
                str(config_path),
                "--ready-file",
                str(ready),
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        try:
            info = await _ready(ready, process, log_path)
            yield Picker(
                info["extproc"], info["metrics"], info["health_port"], log_path, process.pid
            )
        finally:
            await terminate(process, 15)


@dataclass
class GatewayTopology:
    prefills: list[EngineHandle]
    decodes: list[EngineHandle]
    picker: Picker
    url: str  # the gateway
    session: aiohttp.ClientSession

    @property
    def engines(self) -> list[EngineHandle]:
        return [*self.prefills, *self.decodes]

    async def post(
        self, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, CIMultiDict[str]]:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = {"content-type": "application/json", **(headers or {})}
        async with self.session.post(
            self.url + path, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as response:
            return response.status, await response.read(), CIMultiDict(response.headers)

    async def seen(self, engine: EngineHandle) -> list[dict[str, Any]]:
        """What `engine` received, identity probes excluded."""
        return await engine_requests(self.session, engine)

    async def clear(self) -> None:
        await clear_engines(self.session, self.engines)


@contextlib.asynccontextmanager
async def epp_topology(
    variant: Variant,
    n_prefill: int = 1,
    n_decode: int = 1,
    connectors: tuple[str, str] = PUSH,
    engine_flags: Sequence[str] | Callable[[], Sequence[str]] = (),
    endpoint: Callable[[EngineHandle], Any] = address,
    **config: Any,
) -> AsyncIterator[GatewayTopology]:
    """`endpoint`: an engine's entry in its pool's `endpoints` (its address, or a mapping)."""
    async with contextlib.AsyncExitStack() as stack:
        prefills = await start_engines(stack, n_prefill, connectors[0], engine_flags)
        decodes = await start_engines(stack, n_decode, connectors[1], engine_flags)
        addresses = [address(e) for e in [*prefills, *decodes]]
        picker = await stack.enter_async_context(
            running_epp(
                epp_config(
                    [endpoint(e) for e in prefills], [endpoint(e) for e in decodes], **config
                )
            )
        )
        # the InferencePool's members: every pod, prefill and decode alike
        url = await stack.enter_async_context(running_gateway(variant, picker.extproc, addresses))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield GatewayTopology(prefills, decodes, picker, url, session)
