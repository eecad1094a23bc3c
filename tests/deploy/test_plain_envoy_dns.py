"""examples/plain-envoy-dns: the config loads, and the bootstrap `render-envoy` makes from it, as
the example's own comment says to run it, passes `envoy --mode validate` with the pools that
name the DNS sources and the ext_proc the config listens on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from extproc.config import load_config
from tests.support.deploy import ROOT, envoy_validate

EXAMPLE = ROOT / "examples" / "plain-envoy-dns" / "pd-extproc.yaml"


def test_config_names_its_engines_by_dns_only() -> None:
    cfg = load_config(EXAMPLE)
    for pool in (cfg.prefill, cfg.decode):
        assert pool.dns and not pool.endpoints and pool.kubernetes is None


def test_rendered_bootstrap_validates(tmp_path: Path) -> None:
    pd_extproc = str(Path(sys.executable).parent / "pd-extproc")
    rendered = subprocess.run(
        [pd_extproc, "render-envoy", "--config", str(EXAMPLE)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    (tmp_path / "envoy.yaml").write_text(rendered.stdout)
    envoy_validate(tmp_path / "envoy.yaml")
    clusters = {
        c["name"]: c for c in yaml.safe_load(rendered.stdout)["static_resources"]["clusters"]
    }
    assert {"pd_extproc", "decode_pool", "prefill_pool"} <= set(clusters)
    [extproc] = clusters["pd_extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = extproc["endpoint"]["address"]["socket_address"]
    assert f"{address['address']}:{address['port_value']}" == load_config(EXAMPLE).extproc.address
