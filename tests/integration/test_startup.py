"""Loud start-up: a port in use is one line and a non-zero exit, whichever port it is; the
engines' state is summed up once started; a P/D pair that cannot exchange KV is named."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from extproc.process.subprocesses import terminate
from extproc.testing import ephemeral_config, running_sidecar
from tests.support.engines import MODEL, address
from tests.support.polling import until
from tests.support.topology import topology
from vllmsim.launcher import PULL_D, PULL_P, PUSH_D, PUSH_P, running_engine


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
        "prefill": {"endpoints": ["127.0.0.1:9"]},
        "decode": {"endpoints": ["127.0.0.1:10"]},
        "extproc": {"port": 0, "workers": 1},
        "metrics": {"port": 0},
        "envoy": {"listen": {"port": 0}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config | sections))
    return path


async def run_cli(*argv: str, timeout_s: float = 60) -> tuple[int, str]:
    """`pd-extproc argv...` to its end (killed, and the test failed, if it outlives timeout_s)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "extproc",
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
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
        config = write_config(
            tmp_path,
            extproc={"port": extproc},
            metrics={"port": metrics},
            envoy={"listen": {"port": port}},
        )
        code, stderr = await run_cli("up", "--config", str(config))
    assert code == 1
    assert_one_line(stderr, f"127.0.0.1:{port}", "envoy.listen.port")
    assert port_is_free(port), "Envoy still listens on the clients' port"
    assert port_is_free(extproc) and port_is_free(metrics), "the ext_proc is still listening"


# `up` binds no extproc.port: its ext_proc is on a Unix socket (test_grpc_reach.py)
@pytest.mark.parametrize(
    ("command", "section"), [("up", "metrics"), ("serve", "extproc"), ("serve", "metrics")]
)
async def test_an_extproc_or_metrics_port_in_use_fails_in_one_line(
    tmp_path: Path, command: str, section: str
) -> None:
    with held_port() as port:
        code, stderr = await run_cli(
            command, "--config", str(write_config(tmp_path, **{section: {"port": port}}))
        )
    assert code == 1
    assert_one_line(stderr, f"127.0.0.1:{port}", f"{section}.port")


async def test_an_eds_and_access_log_port_in_use_fails_in_one_line(tmp_path: Path) -> None:
    with held_port() as port:
        side = {"port": 0, "eds_access_log": {"port": port}}
        code, stderr = await run_cli("serve", "--config", str(write_config(tmp_path, extproc=side)))
    assert code == 1
    assert_one_line(stderr, f"127.0.0.1:{port}", "extproc.eds_access_log.port")


async def test_demo_on_a_port_another_envoy_holds_fails_in_one_line() -> None:
    with held_port(reuse_port=True) as port:
        code, stderr = await run_cli("demo", "--once", "--port", str(port))
    assert code == 1
    assert_one_line(stderr, f"127.0.0.1:{port}", "--port")
    assert port_is_free(port)


def probes_total(endpoint: str, outcome: str) -> str:
    return f'pd_extproc_identity_probes_total{{endpoint="{endpoint}",outcome="{outcome}"}}'


async def test_a_pull_prefill_with_push_decodes_is_named_in_the_log_on_ready_and_to_clients() -> (
    None
):
    async with topology(connectors=(PULL_P, PUSH_D)) as topo:
        p, d = address(topo.prefills[0]), address(topo.decodes[0])
        status, body, headers = await topo.post(
            "/v1/completions", {"model": MODEL, "prompt": "mismatched", "max_tokens": 4}
        )
        assert status == 502 and headers["content-type"] == "application/json"
        error = orjson.loads(body)["error"]
        assert "KV connectors do not match" in error["message"], error
        assert "NixlConnector (pull)" in error["message"]
        assert "127.0.0.1" not in body.decode()  # no engine address reaches a client
        ready = await topo.ready()
        assert [(m["prefill"], m["decode"]) for m in ready["kv_mismatch"]] == [(p, d)]

        async def probed_again() -> bool:  # the pair is probed every health round (0.5 s)
            return (await topo.metrics()).get(probes_total(p, "failed"), 0) >= 3

        await until(probed_again, "three failed probes")
        assert (await topo.metrics()).get(probes_total(p, "learned"), 0) == 0
        lines = topo.sidecar.log_text().splitlines()
        errors = [line for line in lines if " ERROR extproc.engines.kv_compat: " in line]
        assert len(errors) == 1, lines  # once, not every probe round
        assert f"prefill {p} and decode {d} cannot exchange KV" in errors[0]
        assert "NixlConnector (pull)" in errors[0] and "kv_connector" in errors[0]
        # the start-up probe's own decode leg failed: the probe says so, once too
        said = f"identity probe of prefill {p} failed: its decode leg to {d} answered HTTP 500"
        assert len([line for line in lines if said in line]) == 1, lines


async def test_a_push_prefill_with_pull_decodes_is_listed_on_ready() -> None:
    """D recomputes the prompt (the request succeeds, slowly): /ready and the log say why."""
    async with topology(connectors=(PUSH_P, PULL_D)) as topo:
        p, d = address(topo.prefills[0]), address(topo.decodes[0])
        ready = await topo.ready()
        assert [(m["prefill"], m["decode"]) for m in ready["kv_mismatch"]] == [(p, d)]
        assert ready["kv_mismatch"][0]["prefill_reports"] == "NixlPushConnector (push)"
        assert f"prefill {p} and decode {d} cannot exchange KV" in topo.sidecar.log_text()


async def test_matching_engines_have_no_mismatch_and_a_clean_startup_summary() -> None:
    async with topology() as topo:
        p, d = address(topo.prefills[0]), address(topo.decodes[0])
        assert (await topo.ready())["kv_mismatch"] == []
        log = topo.sidecar.log_text()
        assert " INFO extproc: engines at start-up:\n" in log
        assert f"  prefill {p}: reachable, NixlPushConnector (push), mode auto\n" in log
        assert f"  decode {d}: reachable, " in log
        metrics = await topo.metrics()
        assert metrics.get(probes_total(p, "learned"), 0) >= 1


async def test_the_startup_summary_names_an_unreachable_engine_and_why() -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: connection refused
    async with (
        running_engine("--kv-transfer-config", PUSH_P) as prefill,
        running_engine("--kv-transfer-config", PUSH_D) as decode,
        running_sidecar(ephemeral_config([address(prefill)], [address(decode), dead])) as sidecar,
    ):
        log = sidecar.log_text()
    assert " WARNING extproc: engines at start-up:\n" in log, log  # not all is well
    assert f"  decode {dead}: NOT reachable (connection refused), " in log
    assert f"  decode {address(decode)}: reachable, " in log


async def test_an_engine_that_goes_down_is_logged_with_the_reason() -> None:
    async with topology(n_decode=2) as topo:
        gone = topo.decodes[1]
        os.kill(gone.pid, signal.SIGKILL)
        line = f"decode {address(gone)} is now unhealthy: connection refused"
        await until(lambda: asyncio.sleep(0, line in topo.sidecar.log_text()), line)


async def test_a_second_up_on_the_port_of_a_running_one_fails_and_leaves_it_serving(
    tmp_path: Path,
) -> None:
    async with topology() as first:
        port = int(first.sidecar.url.rsplit(":", 1)[1])
        code, stderr = await run_cli(
            "up", "--config", str(write_config(tmp_path, envoy={"listen": {"port": port}}))
        )
        assert code == 1
        assert_one_line(stderr, f"127.0.0.1:{port}", "envoy.listen.port")
        for _ in range(5):  # every request still reaches the first one's engines
            status, _, _ = await first.post("/v1/completions", {"model": MODEL, "prompt": "mine"})
            assert status == 200
        assert len(await first.seen(first.decodes[0])) == 5
