"""The examples' preStop hooks, run exactly as the YAML writes them (only the ports changed)
against a real Envoy started with the example's drain flags and a real `pd-extproc serve`:

- Kubernetes: Envoy's hook drains the ingress gracefully and returns only once the open stream
  has finished; the pd-extproc hook returns only once Envoy has exited.
- Envoy Gateway: the prefill Envoy's hook returns only once the ext_proc's port is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from extproc.process.envoy_process import envoy_binary
from extproc.process.subprocesses import terminate
from tests.support.engines import MODEL
from tests.support.examples import config, container, hook_command
from tests.support.polling import until
from tests.support.split import split_topology

DRAIN_TIME_S = "1"  # the example's 15 s, shortened
TIMEOUT = aiohttp.ClientTimeout(total=5)


def with_port(command: list[str], old: str, new: str) -> list[str]:
    """The hook's command with one address replaced (the example's ports are fixed)."""
    *head, script = command
    assert old in script, (old, script)
    return [*head, script.replace(old, new)]


async def run_hook(command: list[str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(*command, start_new_session=True)


async def still_running(process: asyncio.subprocess.Process, for_s: float = 1.0) -> bool:
    """True if `process` has not exited within `for_s` (a bounded wait, not a sleep)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(process.wait()), for_s)
    return process.returncode is None


@contextlib.asynccontextmanager
async def example_envoy(bootstrap: Path, run_dir: Path) -> AsyncIterator[tuple[str, str]]:
    """Envoy with the Kubernetes example's flags; yields (admin host:port, ingress URL)."""
    command = list(container("kubernetes", "envoy")["command"])
    command[command.index("-c") + 1] = str(bootstrap)
    command[command.index("--drain-time-s") + 1] = DRAIN_TIME_S
    admin_path = run_dir / "example-envoy-admin"
    with (run_dir / "example-envoy.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            envoy_binary(),
            *command[1:],
            "--admin-address-path",
            str(admin_path),
            "--disable-hot-restart",
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                if not admin_path.exists() or not admin_path.read_text().strip():
                    return False
                with contextlib.suppress(aiohttp.ClientError):
                    url = f"http://{admin_path.read_text().strip()}/ready"
                    async with session.get(url, timeout=TIMEOUT) as response:
                        return response.status == 200
                return False

            await until(ready, "the example's Envoy ready", timeout_s=20)
            admin = admin_path.read_text().strip()
            url = f"http://{admin}/listeners?format=json"
            async with session.get(url, timeout=TIMEOUT) as response:
                listeners = (await response.json())["listener_statuses"]
        [ingress] = [
            x["local_address"]["socket_address"] for x in listeners if x["name"] == "ingress"
        ]
        yield admin, f"http://{ingress['address']}:{ingress['port_value']}"
    finally:
        await terminate(process, 10)


async def refused(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(url, timeout=TIMEOUT):
            return False
    except aiohttp.ClientConnectorError:
        return True


async def test_kubernetes_hooks_finish_the_open_stream_then_stop_envoy_then_the_extproc() -> None:
    async with split_topology() as split:
        await split.envoy.stop()  # replaced by an Envoy with the example's flags
        async with example_envoy(split.tmp / "envoy.yaml", split.tmp) as (admin, url):
            envoy_port = admin.rpartition(":")[2]
            envoy_hook = with_port(
                hook_command("kubernetes", "envoy"), "127.0.0.1/9901", f"127.0.0.1/{envoy_port}"
            )
            extproc_hook = with_port(
                hook_command("kubernetes", "pd-extproc"),
                '"127.0.0.1", 9901',
                f'"127.0.0.1", {envoy_port}',
            )
            body = {"model": MODEL, "prompt": "finish me", "max_tokens": 200, "stream": True}
            async with (
                aiohttp.ClientSession() as session,
                session.post(url + "/v1/completions", json=body) as response,
            ):
                first = await response.content.readline()
                draining = await run_hook(envoy_hook)
                outliving = await run_hook(extproc_hook)

                async def ingress_closed() -> bool:
                    return await refused(url + "/v1/models")

                await until(ingress_closed, "the ingress closed after the drain time", timeout_s=5)
                assert draining.returncode is None  # the stream is still open
                rest = await response.read()
            assert response.status == 200 and b"data: [DONE]" in first + rest
            assert await asyncio.wait_for(draining.wait(), 5) == 0
            assert await still_running(outliving)  # Envoy is still up: it waits
        assert await asyncio.wait_for(outliving.wait(), 5) == 0  # Envoy has exited


async def test_envoy_gateway_prefill_hook_returns_once_the_extproc_port_closes() -> None:
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    metrics = config("envoy-gateway").metrics.port
    hook = await run_hook(
        with_port(
            hook_command("envoy-gateway", "prefill-envoy"),
            f"127.0.0.1/{metrics}",
            f"127.0.0.1/{port}",
        )
    )
    try:
        assert await still_running(hook)
        server.close()
        await server.wait_closed()
        assert await asyncio.wait_for(hook.wait(), 5) == 0
    finally:
        await terminate(hook, 5)
        server.close()
