"""Every dashboard panel gets data from a real Prometheus that labels series as the Prometheus
Operator does on Kubernetes: `namespace`, `pod`, `container`, `endpoint`, `job` (the Service),
`instance` = the scraped address (podIP:port there, which is what the sidecar's `endpoint` label
holds), and no `role` label on the engines' series. The targets are the real processes of
docker-compose.yml's topology (2 prefill + 2 decode vllmsim, the sidecar with its Envoy) with
the default direct P leg, so the prefill_pool cluster of Envoy carries nothing.

The sidecar's jobs are made from the chart's own ServiceMonitor: its metrics, and Envoy's stats,
which the sidecar serves on the same port (Envoy's admin stays on 127.0.0.1 in the pod)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.deploy.prometheus_binary import prometheus_binary, running_prometheus
from tests.support import grafana
from tests.support.compose_topology import (
    COMPLETION,
    DASHBOARD,
    TIMEOUT,
    Topology,
    compose_topology,
)
from tests.support.deploy import one
from tests.support.engines import address
from tests.support.helm import render

SCRAPE_S = 1.0
NAMESPACE = "llm"  # the chart tests' release namespace
SIDECAR_POD = "pd-extproc-6d9f7c5b8-x2k4q"


def target(url: str) -> str:
    return url.removeprefix("http://")


def chart_service_monitor(kube_bin: Path) -> tuple[str, list[dict[str, Any]]]:
    """The chart's ServiceMonitor (gateway mode): the Service it selects and its endpoints."""
    docs = render(kube_bin, "gateway", **{"metrics.serviceMonitor.create": "true"})
    endpoints = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    return one(docs, "Service")["metadata"]["name"], endpoints


def static(url: str, **labels: str) -> dict[str, Any]:
    return {"targets": [target(url)], "labels": {"namespace": NAMESPACE, **labels}}


def job(name: str, statics: list[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    return {"job_name": name, "static_configs": statics, **settings}


def kubernetes_scrape_config(
    topo: Topology, service: str, monitor: list[dict[str, Any]]
) -> dict[str, Any]:
    """What the Operator makes of the chart's ServiceMonitor (a job per endpoint; `job` = the
    Service, `endpoint` = the port's name, honor_labels as the endpoint says) and of a
    PodMonitor per engine pool, as static targets."""
    jobs = []
    for i, endpoint in enumerate(monitor):
        assert endpoint["port"] == "metrics", endpoint  # the sidecar's port: topo.sidecar.metrics
        sidecar = static(
            topo.sidecar.metrics,
            job=service,
            service=service,
            endpoint=endpoint["port"],
            container="pd-extproc",
            pod=SIDECAR_POD,
        )
        jobs.append(
            job(
                f"serviceMonitor/{NAMESPACE}/{service}/{i}",
                [sidecar],
                metrics_path=endpoint.get("path", "/metrics"),
                honor_labels=endpoint.get("honorLabels", False),
            )
        )
    for role, engines in (("prefill", topo.prefills), ("decode", topo.decodes)):
        pods = [
            static(
                f"http://{address(e)}",
                job=f"{NAMESPACE}/vllm-{role}",
                pod=f"vllm-{role}-{i}",
                container="vllm",
                endpoint="http",
            )
            for i, e in enumerate(engines)
        ]
        jobs.append(job(f"podMonitor/{NAMESPACE}/vllm-{role}/0", pods))
    return {"global": {"scrape_interval": f"{SCRAPE_S:g}s"}, "scrape_configs": jobs}


@pytest.mark.timeout(150)
async def test_every_panel_gets_data_with_kubernetes_labels(tmp_path: Path, kube_bin: Path) -> None:
    prometheus_binary()  # skip before starting anything when there is none
    dashboard = grafana.load(DASHBOARD)
    service, monitor = chart_service_monitor(kube_bin)
    # kv_check every second: the transfer share needs two windows with traffic between them
    async with (
        compose_topology(kv_check={"interval_s": 1.0}) as topo,
        running_prometheus(kubernetes_scrape_config(topo, service, monitor), tmp_path) as url,
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        grafana.traffic(session, topo.sidecar.url, COMPLETION) as statuses,
    ):
        prometheus = grafana.Prometheus(session, url)
        found = await grafana.wait_for_every_panel(
            prometheus, dashboard, SCRAPE_S, 90, with_values=("namespace", "pod", "model")
        )
    assert statuses and set(statuses) == {200}, statuses
    assert found["namespace"] == [NAMESPACE] and found["pod"] == [SIDECAR_POD], found
    assert found["model"] == [COMPLETION["model"]], found


def test_engine_panels_need_no_role_label() -> None:
    """The engines' series carry no `role` here, as on Kubernetes: no query may select on it,
    or the panel would be empty there although it has data in docker compose."""
    for query in grafana.panel_queries(grafana.load(DASHBOARD)):
        if "vllm:" in query.expr:
            assert "role=" not in query.expr.split("pd_extproc_endpoint_healthy")[0], query


def test_every_query_follows_the_variables() -> None:
    """A panel that ignores the data source, namespace or pod variable would mix in other
    releases' series (or read the wrong Prometheus) while the others follow the selection."""
    dashboard = grafana.load(DASHBOARD)
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "namespace", "pod", "model"], names
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert '$namespace"' in target["expr"] and '$pod"' in target["expr"], target
            if "model" in target["expr"] or "vllm:" in target["expr"]:
                assert "$model" in target["expr"], target
