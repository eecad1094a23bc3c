"""The commands and configs the documents show, run as they are written.

Read from the documents themselves (not copies): the configuration reference and every config
example parse with the defaults they claim; the `pd-extproc` commands exit as described; the
README's recipe of `up` with hand-started `vllmsim` engines serves a request push-parallel.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import Config, parse_config
from tests.support.deploy import envoy_validate

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
RECIPE_MARKER = "<!-- recipe"


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


def block_after(text: str, marker: str) -> str:
    start = text.index("```", text.index(marker))
    return text[text.index("\n", start) + 1 : text.index("```", start + 3)]


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "pd-extproc"), *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def test_the_configuration_reference_is_the_defaults() -> None:
    """Every key of docs/configuration.md parses (`mode: off` bare included) to the default."""
    (reference,) = fenced((DOCS / "configuration.md").read_text(), "yaml")
    data = yaml.safe_load(reference)
    documented = parse_config(data)
    defaults = parse_config({"prefill": data["prefill"], "decode": data["decode"]})
    for section in Config.model_fields:
        assert getattr(documented, section) == getattr(defaults, section), section


def test_every_config_example_parses() -> None:
    """The README's config and the endpoint picker's fragment (with pools) are valid."""
    pools = {
        "prefill": {"endpoints": ["127.0.0.1:8100"]},
        "decode": {"endpoints": ["127.0.0.1:8200"]},
    }
    examples = [
        *fenced(README.read_text(), "yaml"),
        *fenced((DOCS / "deployment.md").read_text(), "yaml"),
    ]
    assert len(examples) >= 3
    for example in examples:
        data: dict[str, Any] = yaml.safe_load(example)
        parse_config(data if "prefill" in data else pools | data)


def test_the_documented_config_error(tmp_path: Path) -> None:
    doc = (DOCS / "deployment.md").read_text()
    line = "prefill.endpoints.0.address: not a host:port (got 'x')"
    assert f"(`{line}`)" in doc.replace("\n", " ") and "exit code 2" in doc
    config = tmp_path / "pd-extproc.yaml"
    config.write_text("prefill: {endpoints: [x]}\ndecode: {endpoints: ['127.0.0.1:8200']}\n")
    result = _cli("render-envoy", "--config", str(config))
    assert result.returncode == 2 and line in result.stderr.splitlines(), result.stderr


def test_version() -> None:
    result = _cli("--version")
    assert result.returncode == 0 and re.fullmatch(r"pd-extproc \d+\.\d+\.\S+\n", result.stdout)


def test_the_snippet_and_bootstrap_commands(tmp_path: Path) -> None:
    """deployment.md's `render-envoy` commands, run on the example it names; the bootstrap
    passes Envoy's own validation and both match the files in envoy/ rendered from it."""
    doc = (DOCS / "deployment.md").read_text()
    snippet_cmd = (
        "pd-extproc render-envoy --config pd-extproc.yaml --extproc-address "
        "127.0.0.1:50051 --snippet"
    )
    assert snippet_cmd in doc.replace("\n", " ")
    example = ROOT / "examples/plain-envoy"
    snippet = _cli(*snippet_cmd.split()[1:], cwd=example)
    assert snippet.returncode == 0, snippet.stderr
    assert snippet.stdout == (ROOT / "envoy/snippet.yaml").read_text()
    bootstrap = _cli("render-envoy", "--config", "pd-extproc.yaml", cwd=example)
    assert bootstrap.stdout == (ROOT / "envoy/bootstrap.yaml").read_text()
    path = tmp_path / "bootstrap.yaml"
    path.write_text(bootstrap.stdout)
    envoy_validate(path)


# ------------------------------------------------------------------ the `up` + vllmsim recipe


# Below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768 and up by default):
# a port taken there and let go could be handed straight to a bind(0) of the recipe's own
# engines (their side channels) before `up` binds it; one found free here cannot be.
_RECIPE_PORTS = range(20000, 32000)


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports on 127.0.0.1 that nothing holds now, outside the ephemeral range."""
    ports: list[int] = []
    for port in random.sample(_RECIPE_PORTS, len(_RECIPE_PORTS)):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise AssertionError(f"no {count} free ports in {_RECIPE_PORTS}")


def _on_free_ports(script: str) -> tuple[str, dict[str, str]]:
    """The recipe with each of its fixed ports (8000, 8101, 5601, ...) moved to a free one."""
    fixed = sorted(set(re.findall(r"\b(?:5[67]0\d|8[12]0\d|8000|9464)\b", script)))
    mapping = dict(zip(fixed, map(str, _free_ports(len(fixed))), strict=True))
    return re.sub(r"\b(?:5[67]0\d|8[12]0\d|8000|9464)\b", lambda m: mapping[m[0]], script), mapping


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _parallel_requests(metrics_url: str) -> float:
    """pd_extproc_requests_total summed over the requests dispatched in parallel."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pd_extproc_requests_total{") and 'strategy="parallel"' in line
    )


def _identities_learned(metrics_url: str) -> int:
    """How many prefill identities the probes have learnt (pd_extproc_identity_events_total)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        1
        for line in text.splitlines()
        if line.startswith("pd_extproc_identity_events_total{") and 'event="learned"' in line
    )


def test_up_with_hand_started_vllmsim_engines(tmp_path: Path) -> None:
    readme = README.read_text()
    recipe, ports = _on_free_ports(block_after(readme, RECIPE_MARKER))
    curl_block = readme[readme.index("Then, from another shell:") :]
    curl = block_after(curl_block, "Then")
    for fixed, free in ports.items():
        curl = curl.replace(f":{fixed}/", f":{free}/")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    log = (tmp_path / "recipe.log").open("w")
    proc = subprocess.Popen(
        ["bash", "-c", f"set -euo pipefail\n{recipe}"],
        cwd=tmp_path,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline, answer = time.monotonic() + 90, ""
        while time.monotonic() < deadline and '"choices"' not in answer:
            assert proc.poll() is None, (tmp_path / "recipe.log").read_text()
            answer = subprocess.run(
                ["bash", "-c", curl], capture_output=True, text=True, timeout=30
            ).stdout
            if '"choices"' not in answer:
                time.sleep(0.5)  # polling the ingress until the engines are healthy
        assert '"choices"' in answer, (tmp_path / "recipe.log").read_text()[-3000:]
        # A prefill whose identity is not learnt yet is served serially by design: once the
        # probes know both, the README's request is served push-parallel.
        metrics = f"http://127.0.0.1:{ports['9464']}/metrics"
        deadline = time.monotonic() + 60
        while _identities_learned(metrics) < 2:
            assert time.monotonic() < deadline, urllib.request.urlopen(metrics).read()[-2000:]
            time.sleep(0.2)  # polling until the probes have learnt both identities
        before = _parallel_requests(metrics)
        answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=30)
        assert '"choices"' in answer.stdout, answer
        # the sidecar sent both legs at once (how the engines then met depends on P's speed:
        # a prompt this short may be prefilled before D registers)
        deadline = time.monotonic() + 10
        while _parallel_requests(metrics) < before + 1:
            assert time.monotonic() < deadline, urllib.request.urlopen(metrics).read()[-2000:]
            time.sleep(0.1)  # polling: the outcome is counted from Envoy's access log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.mark.parametrize("port", ["5601", "8101"])
def test_the_recipe_moves_every_port(port: str) -> None:
    recipe, ports = _on_free_ports(block_after(README.read_text(), RECIPE_MARKER))
    assert port in ports and port not in recipe


def test_the_simulator_flags_the_docs_name_exist() -> None:
    doc = (DOCS / "simulator.md").read_text()
    named = set(re.findall(r"`(--[a-z][a-z-]+)", doc))
    assert {"--profile", "--kv-block-offset", "--api-key", "--kv-transfer-config"} <= named
    result = subprocess.run(
        [str(BIN / "vllmsim"), "--help"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    assert not [flag for flag in named if flag not in result.stdout], result.stdout
