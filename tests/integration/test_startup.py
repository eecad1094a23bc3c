"""Loud start-up: a port in use is one line and a non-zero exit, whichever port it is."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.subprocesses import terminate


@contextlib.contextmanager
def held_port(reuse_port: bool = False) -> Iterator[int]:
    """A listening socket on a free loopback port. `reuse_port` is what an Envoy listener does
    by default on Linux: a second SO_REUSEPORT socket may then bind the same port."""
    with socket.socket() as holder:
        if reuse_port:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Nothing listens on `port` any more (a plain bind, without SO_REUSEPORT, succeeds)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def write_config(tmp_path: Path, **sections: Any) -> Path:
    config: dict[str, Any] = {
        "prefill": {"endpoints": ["127.0.0.1:9"]}, "decode": {"endpoints": ["127.0.0.1:10"]},
        "extproc": {"port": 0}, "metrics": {"port": 0}, "envoy": {"listen": {"port": 0}},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config | sections))
    return path


async def run_cli(*argv: str, timeout_s: float = 60) -> tuple[int, str]:
    """`pd-extproc argv...` to its end (killed, and the test failed, if it outlives timeout_s)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "extproc", *argv, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        await terminate(process, 5)
        raise AssertionError(f"pd-extproc {argv[0]} kept running on a port in use") from None
    assert process.returncode is not None
    return process.returncode, stderr.decode()


def assert_one_line(stderr: str, address: str, setting: str) -> None:
    assert "Traceback" not in stderr, stderr
    said = [line for line in stderr.splitlines() if line.startswith("pd-extproc:")]
    assert said == [
        f"pd-extproc: cannot start: {address} is already in use (another pd-extproc or Envoy?): "
        f"stop what holds it, or choose another port with {setting}"
    ], stderr


@pytest.mark.parametrize("reuse_port", [True, False], ids=["another-envoy", "plain-socket"])
async def test_up_on_a_clients_port_in_use_fails_in_one_line(
    tmp_path: Path, reuse_port: bool
) -> None:
    extproc, metrics = free_port(), free_port()
    with held_port(reuse_port) as port:
        config = write_config(tmp_path, extproc={"port": extproc}, metrics={"port": metrics},
                              envoy={"listen": {"port": port}})  # fmt: skip
        code, stderr = await run_cli("up", "--config", str(config))
    assert code == 1
    assert_one_line(stderr, f"127.0.0.1:{port}", "envoy.listen.port")
    assert port_is_free(port), "Envoy still listens on the clients' port"
    assert port_is_free(extproc) and port_is_free(metrics), "the ext_proc is still listening"


@pytest.mark.parametrize("command", ["up", "serve"])
@pytest.mark.parametrize("section", ["extproc", "metrics"])
async def test_an_extproc_or_metrics_port_in_use_fails_in_one_line(
    tmp_path: Path, command: str, section: str
) -> None:
    with held_port() as port:
        code, stderr = await run_cli(
            command, "--config", str(write_config(tmp_path, **{section: {"port": port}}))
        )
    assert code == 1
    assert_one_line(stderr, f"127.0.0.1:{port}", f"{section}.port")


async def test_demo_on_a_port_another_envoy_holds_fails_in_one_line() -> None:
    with held_port(reuse_port=True) as port:
        code, stderr = await run_cli("demo", "--once", "--port", str(port))
    assert code == 1
    assert_one_line(stderr, f"127.0.0.1:{port}", "--port")
    assert port_is_free(port)
