"""docker-compose.yml, the Dockerfile and deploy/: consistent with each other and valid.

What can be checked without a Docker engine, in the fast suite: `docker-compose config`, the
rendered Envoy bootstrap (golden file + `envoy --mode validate`) and the addresses shared
between files. tests/compose/ brings the topology up in real containers.
"""

from __future__ import annotations

import io
import ipaddress
import json
import re
import shutil
import subprocess
from contextlib import redirect_stdout
from typing import Any

import pytest
import yaml

from extproc.cli import main as cli_main
from extproc.config import load_config
from extproc.process.envoy_process import envoy_binary
from tests.support.deploy import ROOT, envoy_validate

COMPOSE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
CONFIG = DEPLOY / "pd-extproc.yaml"
ENVOY = ROOT / "envoy" / "compose-bootstrap.yaml"
PREFILL_LISTENER = "127.0.0.1:10001"
RENDER = ["render-envoy", "--config", str(CONFIG), "--prefill-listener", PREFILL_LISTENER]
ENGINE_PORT = 8000


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())  # safe_load resolves the x-engine anchor


def rendered(argv: list[str]) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(argv) == 0
    return out.getvalue()


def test_envoy_bootstrap_is_rendered_from_the_config() -> None:
    expected = rendered(RENDER)
    assert ENVOY.read_text() == expected, (
        "envoy/compose-bootstrap.yaml is stale; regenerate it with: python envoy/regenerate.py"
    )


def test_envoy_bootstrap_passes_envoy_validate() -> None:
    envoy_validate(ENVOY)


def test_envoy_listens_where_compose_publishes_it() -> None:
    cfg = load_config(CONFIG)
    assert (cfg.envoy.listen.host, cfg.envoy.admin.host) == ("0.0.0.0", "0.0.0.0")
    assert cfg.envoy.prefill_listener == PREFILL_LISTENER  # loopback in Envoy's namespace
    published = {p.split(":")[-1] for p in compose()["services"]["envoy"]["ports"]}
    assert {str(cfg.envoy.listen.port), str(cfg.envoy.admin.port), str(cfg.metrics.port)} == (
        published
    )


def _engines(role: str) -> dict[str, dict[str, Any]]:
    services = compose()["services"]
    return {name: svc for name, svc in services.items() if name.startswith(f"{role}-")}


def _ip(service: dict[str, Any]) -> str:
    return service["networks"]["pd"]["ipv4_address"]


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_engines_match_the_config(role: str, kv_role: str) -> None:
    cfg = load_config(CONFIG)
    pool = cfg.prefill if role == "prefill" else cfg.decode
    engines = _engines(role)
    assert len(engines) == 2
    assert {f"{_ip(s)}:{ENGINE_PORT}" for s in engines.values()} == {
        e.address for e in pool.endpoints
    }
    subnet = ipaddress.ip_network(compose()["networks"]["pd"]["ipam"]["config"][0]["subnet"])
    for service in engines.values():
        assert ipaddress.ip_address(_ip(service)) in subnet
        # P reports this host to D verbatim: it must be the engine's own address
        assert service["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == _ip(service)
        command = service["command"]
        assert command[:5] == ["vllmsim", "--host", "0.0.0.0", "--port", str(ENGINE_PORT)]
        assert kv_role in command[command.index("--kv-transfer-config") + 1]


def test_sidecar_shares_envoys_network_namespace() -> None:
    sidecar = compose()["services"]["pd-extproc"]
    assert sidecar["network_mode"] == "service:envoy"
    assert sidecar["command"][:2] == ["pd-extproc", "serve"]
    cfg = load_config(CONFIG)
    assert "--prefill-listener" not in sidecar["command"]  # the config's, as render-envoy's
    assert cfg.envoy.shared_prefill_listener() == PREFILL_LISTENER
    assert cfg.extproc.host == "127.0.0.1"  # only Envoy, in the same namespace, reaches it


def test_envoy_image_matches_the_tested_envoy() -> None:
    version = subprocess.run(
        [envoy_binary(), "--version"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    major_minor = re.search(r"/(\d+\.\d+)\.\d+/", version)
    assert major_minor, version
    image = compose()["services"]["envoy"]["image"]  # ${ENVOY_IMAGE:-default}
    assert image == f"${{ENVOY_IMAGE:-envoyproxy/envoy:v{major_minor.group(1)}-latest}}"


def test_mounted_files_exist() -> None:
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), f"{name} mounts missing {source}"


def test_prometheus_scrapes_every_exporter() -> None:
    cfg = load_config(CONFIG)
    jobs = {
        j["job_name"]: j
        for j in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
    }
    targets = {
        name: {t for static in job["static_configs"] for t in static["targets"]}
        for name, job in jobs.items()
    }
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert targets["envoy"] == {f"envoy:{cfg.envoy.admin.port}"}
    assert targets["pd-extproc"] == {f"envoy:{cfg.metrics.port}"}  # Envoy's namespace
    # by the addresses the sidecar's `endpoint` label holds: the dashboard joins the two
    for role, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        [static] = [s for s in jobs["vllm"]["static_configs"] if s["labels"]["role"] == role]
        assert set(static["targets"]) == {e.address for e in pool.endpoints}
        ips = {f"{_ip(s)}:{ENGINE_PORT}" for s in _engines(role).values()}
        assert ips == set(static["targets"])


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    provisioning = DEPLOY / "grafana" / "provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "pd-extproc.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    host_dir = next(src for src, dst in mounts.items() if dst == path)
    assert (ROOT / host_dir / "pd-extproc.json").exists()
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ][0]
    assert datasource["url"] == "http://prometheus:9090"


def test_dockerfile_runs_as_non_root_from_python_slim() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=python:3\.11-slim\s*$", text, re.M)
    assert re.search(r"^FROM \$\{BASE\}\s*$", text, re.M)
    user = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert user and user[-1].split(":")[0] not in {"root", "0"}
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for source in re.findall(r"^COPY\s+(.+?)\s+\S+\s*$", text, re.M):
        for item in source.split():
            if item == "wheelhous[e]":  # optional: pre-built wheels for an offline build
                continue
            assert (ROOT / item).exists() and item not in ignored, item


def _compose_command() -> list[str] | None:
    if found := shutil.which("docker-compose"):
        return [found]
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30
        ).returncode
        == 0
    ):
        return [docker, "compose"]
    return None


def test_docker_compose_config_accepts_the_file() -> None:
    command = _compose_command()
    if command is None:
        pytest.skip(
            "no docker-compose binary (CI: apt-get install -y --no-install-recommends "
            "docker-compose); the engine is not needed for `config`"
        )
    result = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_decode_ttft_panel_says_it_is_not_the_clients_ttft() -> None:
    """The engines' TTFT metric starts when D gets its request: in serial dispatch that is
    after the prefill, so a panel of it must not pass for the client's TTFT."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pd-extproc.json").read_text())
    metric = "vllm:time_to_first_token_seconds"
    panels = [p for p in dashboard["panels"] if any(metric in t["expr"] for t in p["targets"])]
    assert panels
    for panel in panels:
        assert panel["title"].startswith("Decode engine TTFT"), panel["title"]
        assert "not the client's" in panel["title"] and "serial" in panel["description"]
