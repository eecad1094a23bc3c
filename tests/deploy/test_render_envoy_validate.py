"""`pd-extproc render-envoy`, as a user runs it, prints a bootstrap Envoy accepts: every example
config, an ext_proc named by host (a Service), and every duration at the ends of its range."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from tests.support.deploy import ROOT, envoy_validate

POOLS = {"prefill": {"endpoints": ["127.0.0.1:8100"]}, "decode": {"endpoints": ["127.0.0.1:8200"]}}


def _durations(at: str) -> dict[str, Any]:
    """Every duration Envoy's bootstrap carries, at the low or high end of its range."""
    low = at == "low"
    return {
        "timeouts": {
            "prefill_s": 0.01 if low else 3000,
            "probe_s": 0.1 if low else 600,
            "connect_s": 0.01 if low else 60,
            "extproc_message_s": 0.001 if low else 3600,
            "drain_s": 0.1 if low else 86400,
            "decode_error_grace_s": 0.01 if low else 60,
            "kv_wait_s": 0.1 if low else 86400,
            "request_s": 0.1 if low else 604800,
            "upload_idle_s": 0.05 if low else 3600,
        },
        "access_log": {"flush_interval_s": 0.01 if low else 60},
        "limits": {"max_body_bytes": 1 if low else 1024**3},
    }


def _render(config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "extproc", "render-envoy", "--config", str(config), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _validate_render(tmp_path: Path, config: Path, *flags: str) -> None:
    result = _render(config, *flags)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "bootstrap.yaml"
    out.write_text(result.stdout)
    envoy_validate(out)


@pytest.mark.parametrize(
    "example", sorted(p.relative_to(ROOT) for p in (ROOT / "examples").glob("*/pd-extproc.yaml"))
)
def test_every_example_renders_a_bootstrap_envoy_accepts(tmp_path: Path, example: Path) -> None:
    config = yaml.safe_load((ROOT / example).read_text())
    if tls := config["extproc"].get("tls"):  # the pod's Secret: real files here, same names
        ca = trustme.CA()
        cert = ca.issue_cert(tls["server_name"])
        cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "tls.pem"))
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        tls |= {
            "cert_file": str(tmp_path / "tls.pem"),
            "key_file": str(tmp_path / "tls.pem"),
            "ca_file": str(tmp_path / "ca.pem"),
        }
    path = tmp_path / "pd-extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    _validate_render(tmp_path, path, "--extproc-address", "127.0.0.1:50051")


@pytest.mark.parametrize("address", ["localhost:50051", "pd-extproc.llm.svc:50051"])
def test_an_extproc_named_by_host_is_resolved(tmp_path: Path, address: str) -> None:
    """A STATIC cluster takes IP addresses only: Envoy refused 'malformed IP address'."""
    config = tmp_path / "pd-extproc.yaml"
    config.write_text(yaml.safe_dump(POOLS))
    _validate_render(tmp_path, config, "--extproc-address", address)


@pytest.mark.parametrize("at", ["low", "high"])
def test_durations_at_the_ends_of_their_ranges(tmp_path: Path, at: str) -> None:
    """A long timeout was written '1e+09s', a body limit past 32 bits overflowed Envoy's
    buffer field: the ranges keep every accepted value renderable."""
    config = tmp_path / "pd-extproc.yaml"
    config.write_text(yaml.safe_dump(POOLS | _durations(at)))
    _validate_render(tmp_path, config)


def test_a_bad_extproc_address_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "pd-extproc.yaml"
    config.write_text(yaml.safe_dump(POOLS))
    result = _render(config, "--extproc-address", "nohost")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "ext_proc address 'nohost': not a host:port" in result.stderr


@pytest.mark.parametrize("side", ["127.0.0.1:50052", "unix:/run/pd-extproc/feeds.sock"])
@pytest.mark.parametrize("snippet", [False, True], ids=["bootstrap", "snippet"])
def test_eds_and_the_access_log_on_their_own_listener(
    tmp_path: Path, side: str, snippet: bool
) -> None:
    """extproc.eds_access_log: the pools' EDS and the access log through a cluster of their
    own, which Envoy accepts; the ext_proc's cluster carries neither."""
    host, _, port = side.rpartition(":") if not side.startswith("unix:") else (side, "", "0")
    listen = {"host": host, "port": int(port)}
    config = tmp_path / "pd-extproc.yaml"
    extproc = {"port": 50051, "eds_access_log": listen}
    config.write_text(yaml.safe_dump(POOLS | {"extproc": extproc}))
    flags = ["--snippet"] if snippet else []
    result = _render(config, *flags)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    clusters = rendered["clusters"] if snippet else rendered["static_resources"]["clusters"]
    feeds = [c for c in clusters if c["name"] == "pd_extproc_eds_access_log"]
    assert len(feeds) == 1
    text = yaml.safe_dump(rendered)
    assert text.count("cluster_name: pd_extproc_eds_access_log") == 4  # 2 pools, log, itself
    if not snippet:
        out = tmp_path / "bootstrap.yaml"
        out.write_text(result.stdout)
        envoy_validate(out)


def test_a_side_listener_off_loopback_is_refused_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "pd-extproc.yaml"
    side = {"eds_access_log": {"host": "0.0.0.0", "port": 50052}}
    config.write_text(yaml.safe_dump(POOLS | {"extproc": side}))
    result = _render(config)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "extproc.eds_access_log: " in result.stderr and "loopback" in result.stderr
