"""`docker compose up` for real: the demo topology in containers, requests through it.

Marked `compose` (not in the default run): it needs a Docker engine and the images of
scripts/local_docker.py, which `.ci/run` prepares. The stand-in images replace the registry
ones through the compose file's own variables; everything else is the file as users run it.
Published ports are picked free on 127.0.0.1; the engines are read on the compose network.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml

from extproc.config import load_config
from extproc.roles import Role
from extproc.testing import scrape
from scripts.local_docker import BASE_IMAGE, PRODUCT_IMAGE
from tests.support import grafana
from tests.support.topology import identity_events

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parent.parent.parent
PROJECT = "pdextproc-ci"
SERVICES = ("envoy", "pd-extproc", "prefill-1", "prefill-2", "decode-1", "decode-2", "prometheus")
DECODES = ("172.28.0.21:8000", "172.28.0.22:8000")  # docker-compose.yml's static addresses
UP_WITHIN_S = 180.0
REQUESTS = 8
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "pd-extproc.json"
PREFILLS = load_config(ROOT / "deploy" / "pd-extproc.yaml").static_addresses(Role.PREFILL)
# the sidecar's kv_check window is 10 s: the transfer share needs two with traffic between
PANELS_WITHIN_S = 90.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Compose:
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.env['PD_EXTPROC_PORT']}"

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.env['PD_EXTPROC_METRICS_PORT']}"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.env['PROMETHEUS_PORT']}"

    def run(self, *args: str, timeout_s: float = 300) -> str:
        done = subprocess.run(
            ["docker-compose", "-p", PROJECT, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)}: {done.stderr[-2000:]}")
        return done.stdout


@contextlib.asynccontextmanager
async def compose_up() -> AsyncIterator[Compose]:
    ports = ("PD_EXTPROC_PORT", "PD_EXTPROC_METRICS_PORT", "ENVOY_ADMIN_PORT", "PROMETHEUS_PORT")
    compose = Compose(
        {
            **os.environ,
            **{name: str(free_port()) for name in ports},
            "ENVOY_IMAGE": PRODUCT_IMAGE,
            "PROMETHEUS_IMAGE": BASE_IMAGE,
        }
    )
    compose.run("down", "-v", "--remove-orphans")  # what an interrupted run left behind
    started = time.monotonic()
    try:
        await asyncio.to_thread(compose.run, "up", "-d", "--no-build", *SERVICES)
        print(f"compose: containers created in {time.monotonic() - started:.1f} s")
        yield compose
    finally:
        logs = compose.run("logs", "--no-color", "--tail", "30", "envoy", "pd-extproc")
        compose.run("down", "-v", "--remove-orphans", timeout_s=120)
        print(f"compose: last log lines before teardown:\n{logs}")


async def poll(check: Callable[[], Awaitable[bool]], what: str, within_s: float) -> float:
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > within_s:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        await asyncio.sleep(0.5)
    return time.monotonic() - started


def scrape_interval_s() -> float:
    interval = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["global"]
    return float(str(interval["scrape_interval"]).removesuffix("s"))


async def every_panel_gets_data(session: aiohttp.ClientSession, compose: Compose) -> None:
    """Each query of each panel, as Grafana sends it (variables at All, then at each value),
    returns data from the compose Prometheus while requests keep coming."""
    body = {"model": "sim-model", "prompt": "dashboard " * 64, "max_tokens": 8}
    prometheus = grafana.Prometheus(session, compose.prometheus)
    started = time.monotonic()
    async with grafana.traffic(session, compose.url, body) as statuses:
        found = await grafana.wait_for_every_panel(
            prometheus,
            grafana.load(DASHBOARD),
            scrape_interval_s(),
            PANELS_WITHIN_S,
            with_values=("model",),
        )
    assert statuses and set(statuses) == {200}, statuses
    queries = len(grafana.panel_queries(grafana.load(DASHBOARD)))
    took = time.monotonic() - started
    print(
        f"compose: all {queries} dashboard queries had data after {took:.1f} s "
        f"({len(statuses)} requests; variables {found})"
    )


@pytest.mark.timeout(UP_WITHIN_S + 30 + 60 + PANELS_WITHIN_S + 60)
async def test_compose_topology_serves_push_parallel_and_prometheus_scrapes_it() -> None:
    timeout = aiohttp.ClientTimeout(total=10)
    async with compose_up() as compose, aiohttp.ClientSession(timeout=timeout) as session:
        body = {"model": "sim-model", "prompt": "compose " * 64, "max_tokens": 8}

        async def served() -> bool:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.post(compose.url + "/v1/completions", json=body) as got:
                    return got.status == 200
            return False

        async def identities_known() -> bool:
            # A request to a P whose identity the probe has not learnt yet goes serially, by
            # design: count push-parallel only once every P's identity is known (/ready shows
            # no engine detail in this deployment: the probe's counters say it).
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                samples = await scrape(session, compose.metrics + "/metrics")
                return all(samples.get(identity_events(p, "learned"), 0) >= 1 for p in PREFILLS)
            return False

        up_s = await poll(served, "a 200 through the published port", UP_WITHIN_S)
        print(f"compose: first 200 after {up_s:.1f} s")
        await poll(identities_known, "every prefill identity learnt", 30)
        statuses = []
        for i in range(REQUESTS):
            request = {**body, "prompt": f"request {i} " + body["prompt"]}
            async with session.post(compose.url + "/v1/completions", json=request) as got:
                statuses.append(got.status)
        assert statuses == [200] * REQUESTS

        kv = []
        for decode in DECODES:
            async with session.get(f"http://{decode}/sim/requests") as got:
                kv += [r["kv"] for r in await got.json() if r["x_request_id"].count("-") == 4]
        assert kv.count("push-parallel") >= REQUESTS, kv  # the probes are not counted here
        samples = await scrape(session, compose.metrics + "/metrics")
        parallel = sum(
            v
            for k, v in samples.items()
            if k.startswith("pd_extproc_requests_total") and 'strategy="parallel"' in k
        )
        assert parallel >= REQUESTS, samples

        async def prometheus_has_it() -> bool:
            query = {"query": 'sum(pd_extproc_requests_total{strategy="parallel"})'}
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(compose.prometheus + "/api/v1/query", params=query) as got:
                    result = (await got.json())["data"]["result"]
                    return bool(result) and float(result[0]["value"][1]) >= REQUESTS
            return False

        scraped_s = await poll(prometheus_has_it, "Prometheus scraping the sidecar", 60)
        print(
            f"compose: {REQUESTS + 1} requests served push-parallel; Prometheus had them "
            f"{scraped_s:.1f} s later"
        )
        await every_panel_gets_data(session, compose)
