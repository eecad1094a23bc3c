"""One process's life (`extproc.process.lifecycle.run`), the same for up, serve and epp: the
order of its steps, SIGHUP reloads from binding on, and how it ends (a stop drains, a failure of
the service does not and exits 1)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from extproc.process.lifecycle import run


class Addresses:
    banner = "fake is up"

    def to_json(self) -> bytes:
        return b'{"extproc": "127.0.0.1:1"}'


class FakeService:
    def __init__(self, fail_start: bool = False) -> None:
        self.steps: list[str] = []
        self.fail_start = fail_start
        self.started = asyncio.Event()
        self.reloaded = asyncio.Event()
        self.failure: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def bind(self) -> None:
        self.steps.append("bind")

    async def start(self) -> Addresses:
        self.steps.append("start")
        if self.fail_start:
            raise OSError("probe failed")
        self.started.set()
        return Addresses()

    async def reload(self, config_path: Path) -> None:
        self.steps.append(f"reload {config_path.name}")
        self.reloaded.set()

    async def failed(self) -> str:
        return await self.failure

    async def drain(self) -> None:
        self.steps.append("drain")

    async def stop(self) -> None:
        self.steps.append("stop")


async def test_a_stop_drains_then_stops_and_sighup_reloads_meanwhile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    service, stop = FakeService(), asyncio.Event()
    ready = tmp_path / "ready.json"
    running = asyncio.create_task(run(service, tmp_path / "c.yaml", ready, stop))
    await asyncio.wait_for(service.started.wait(), 5)
    os.kill(os.getpid(), signal.SIGHUP)
    await asyncio.wait_for(service.reloaded.wait(), 5)
    stop.set()
    assert await asyncio.wait_for(running, 5) == 0
    assert service.steps == ["bind", "start", "reload c.yaml", "drain", "stop"]
    assert json.loads(ready.read_text()) == {"extproc": "127.0.0.1:1"}
    assert "fake is up" in capsys.readouterr().out
    # SIGHUP is no longer taken: its handler is back to the default
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


async def test_a_failure_of_the_service_exits_1_without_a_drain() -> None:
    service, stop = FakeService(), asyncio.Event()
    running = asyncio.create_task(run(service, Path("c.yaml"), None, stop))
    await asyncio.wait_for(service.started.wait(), 5)
    service.failure.set_result("Envoy exited (1)")
    assert await asyncio.wait_for(running, 5) == 1
    assert service.steps == ["bind", "start", "stop"]


async def test_a_failed_start_raises_and_leaves_the_cleanup_to_the_service() -> None:
    service = FakeService(fail_start=True)
    with pytest.raises(OSError, match="probe failed"):
        await asyncio.wait_for(run(service, Path("c.yaml"), None, asyncio.Event()), 5)
    assert service.steps == ["bind", "start"]
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
