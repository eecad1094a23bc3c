from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.config import ConfigError, DispatchMode, parse_config
from extproc.envoy_config import render_bootstrap, render_yaml
from extproc.envoy_process import envoy_binary
from extproc.runtime import Runtime

MINIMAL = {
    "prefill": {"endpoints": ["127.0.0.1:8100"]},
    "decode": {"endpoints": ["127.0.0.1:8200"]},
}


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_config(MINIMAL)
    assert cfg.dispatch.mode is DispatchMode.AUTO and cfg.dispatch.probe
    assert Runtime(cfg, "unix:/x").prefill_mode("127.0.0.1:8100") is DispatchMode.AUTO


def test_per_endpoint_mode() -> None:
    cfg = parse_config(
        MINIMAL
        | {
            "prefill": {
                "endpoints": [{"address": "127.0.0.1:8100", "mode": "pull"}, "127.0.0.1:8101"]
            }
        }
    )
    runtime = Runtime(cfg, "unix:/x")
    assert runtime.prefill_mode("127.0.0.1:8100") is DispatchMode.PULL
    assert runtime.prefill_mode("127.0.0.1:8101") is DispatchMode.AUTO


def test_every_problem_is_one_line() -> None:
    bad = {
        "prefill": {"endpoints": ["nope", "127.0.0.1:99999"]},
        "decode": {"endpoints": []},
        "dispatch": {"mode": "fast"},
        "typo": 1,
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(bad)
    lines = str(caught.value).splitlines()
    assert any(line.startswith("prefill.endpoints.0.address: not a host:port") for line in lines)
    assert any("65535" in line for line in lines)
    assert "decode: give endpoints, dns or kubernetes" in lines
    assert any(line.startswith("dispatch.mode:") for line in lines)
    assert any(line.startswith("typo:") for line in lines)


def test_endpoints_are_ip_addresses_and_names_go_under_dns() -> None:
    """Envoy's pools refuse a name ("malformed IP address"): say so at the config check."""
    with pytest.raises(ConfigError) as caught:
        parse_config(MINIMAL | {"decode": {"endpoints": ["vllm-d0:8200"]}})
    assert str(caught.value) == (
        "decode.endpoints.0.address: an IP address, not a name (got 'vllm-d0:8200'); "
        "give names with dns: (or kubernetes:)"
    )
    assert parse_config(MINIMAL | {"decode": {"dns": "vllm-d0:8200"}}).decode.dns
    assert parse_config(MINIMAL | {"decode": {"endpoints": ["[::1]:8200"]}})


def test_prefill_listener_must_be_local() -> None:
    with pytest.raises(ConfigError, match="loopback"):
        parse_config(MINIMAL | {"envoy": {"prefill_listener": "0.0.0.0:9000"}})


def test_cli_reports_bad_config_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"prefill": {"endpoints": ["x"]}}))
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "render-envoy", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "decode: Field required" in result.stderr


@pytest.mark.parametrize("listener", ["unix:/tmp/pd-extproc-test.sock", "127.0.0.1:10001"])
def test_rendered_bootstrap_passes_envoy_validate(tmp_path: Path, listener: str) -> None:
    cfg = parse_config(MINIMAL | {"decode": {"endpoints": ["127.0.0.1:8200", "127.0.0.2:8200"]}})
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(render_bootstrap(cfg, "127.0.0.1:50051", listener)))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr
