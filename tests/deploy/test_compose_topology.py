"""docker-compose.yml's topology as plain processes: 2 prefill + 2 decode vllmsim engines and
the sidecar (Envoy + ext_proc) on ephemeral loopback ports. After some requests, every metric
and label that the Grafana dashboard queries must be exported by someone, so a dashboard that
references a metric nobody exports fails here rather than showing "No data" in production."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.deploy.promql import Query, dashboard_queries, variable_queries
from tests.support.compose_topology import (
    COMPLETION,
    DASHBOARD,
    TIMEOUT,
    Topology,
    compose_topology,
)

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
KV_SHARE = "pd_extproc_decode_kv_transfer_share"  # needs a second kv_check window


# What the Prometheus Operator attaches on Kubernetes and the dashboard's variables select on;
# in docker compose they are absent, and the variables' "All" (.*) matches an absent label.
KUBERNETES_TARGET_LABELS = {"namespace", "pod"}


def prometheus_added_labels() -> set[str]:
    """Labels Prometheus attaches at scrape time (job, instance, static_configs labels, and on
    Kubernetes the Operator's target labels)."""
    added = {"job", "instance", *KUBERNETES_TARGET_LABELS}
    for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]:
        for static in job.get("static_configs", []):
            added |= set(static.get("labels", {}))
    return added


async def exported(session: aiohttp.ClientSession, url: str) -> dict[str, set[str]]:
    """Sample name → every label name seen on it, from one Prometheus text endpoint."""
    async with session.get(url, timeout=TIMEOUT) as response:
        assert response.status == 200, url
        text = await response.text()
    return exposition_labels(text)


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')


def exposition_labels(text: str) -> dict[str, set[str]]:
    """Sample names exactly as exposed (what Prometheus stores; prometheus_client's parser
    would add `_total` to Envoy's counters) → the label names seen on them."""
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and (match := _SAMPLE.match(line)):
            names = set(_LABEL.findall(match.group(2) or ""))
            labels.setdefault(match.group(1), set()).update(names)
    return labels


async def scrape_all(session: aiohttp.ClientSession, topo: Topology) -> dict[str, set[str]]:
    urls = [
        topo.sidecar.metrics + "/metrics",
        topo.sidecar.envoy_admin + "/stats/prometheus",
        *(e.url + "/metrics" for e in [*topo.prefills, *topo.decodes]),
    ]
    merged: dict[str, set[str]] = {}
    for url in urls:
        for name, names in (await exported(session, url)).items():
            merged.setdefault(name, set()).update(names)
    return merged


async def scrape_until_logged(
    session: aiohttp.ClientSession, topo: Topology, timeout_s: float = 10.0
) -> dict[str, set[str]]:
    """Scrape until the client-latency histograms and the KV-transfer share exist: Envoy flushes
    its access-log entries every 0.1 s, so they may trail the responses, and the share needs a
    second kv_check window; the last scrape is returned either way."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        metrics = await scrape_all(session, topo)
        wanted = ("pd_extproc_client_duration_seconds_bucket", KV_SHARE)
        logged = all(name in metrics for name in wanted)
        if logged or asyncio.get_running_loop().time() > deadline:
            return metrics
        await asyncio.sleep(0.1)


def problems(query: Query, metrics: dict[str, set[str]], added: set[str]) -> list[str]:
    found = []
    for name in sorted(query.metrics - set(metrics)):
        found.append(f"{name}: not exported")
    for name, labels in query.selector_labels.items():
        for label in sorted(labels - metrics.get(name, set()) - added):
            found.append(f"{name}: no label {label!r}")
    available = set().union(*(metrics.get(n, set()) for n in query.metrics)) | added
    for label in sorted(query.grouping_labels - available):
        found.append(f"no metric of the query has label {label!r}")
    return [f"{query.expr}\n    {p}" for p in found]


def test_dashboard_queries_were_found() -> None:
    queries = dashboard_queries(DASHBOARD)
    names = set().union(*(q.metrics for q in queries))
    # the panels the dashboard must have; guards the reader above against reading nothing
    for wanted in (
        "vllm:time_to_first_token_seconds_bucket",
        "pd_extproc_client_time_to_first_byte_seconds_bucket",
        "pd_extproc_requests_total",
        "pd_extproc_dispatch_skew_seconds_bucket",
        "pd_extproc_identity_events_total",
        "pd_extproc_inflight_requests",
        "pd_extproc_endpoint_healthy",
        "pd_extproc_prefill_leg_seconds_count",
        "pd_extproc_decode_kv_transfer_share",
        "vllm:prompt_tokens_by_source_total",
    ):
        assert wanted in names


@pytest.mark.timeout(120)
async def test_every_dashboard_metric_is_exported() -> None:
    async with (
        compose_topology(kv_check={"interval_s": 0.5}) as topo,
        aiohttp.ClientSession() as session,
    ):
        for _ in range(6):
            async with session.post(
                topo.sidecar.url + "/v1/completions", json=COMPLETION, timeout=TIMEOUT
            ) as response:
                assert response.status == 200, await response.text()
        metrics = await scrape_until_logged(session, topo)
    added = prometheus_added_labels()
    queries = dashboard_queries(DASHBOARD) + variable_queries(DASHBOARD)
    found = [p for q in queries for p in problems(q, metrics, added)]
    assert not found, "the dashboard queries what nobody exports:\n" + "\n".join(found)


def test_the_client_latency_panels_query_what_the_sidecar_exports_by_strategy() -> None:
    """Without Docker: the client-latency panels against the sidecar's own instruments."""
    from extproc.metrics import Metrics

    metrics = Metrics()
    exported = {
        f"{instrument._name}_bucket": {*instrument._labelnames, "le"}
        for instrument in (metrics.client_first_byte_seconds, metrics.client_duration_seconds)
    }
    queries = [q for q in dashboard_queries(DASHBOARD) if q.metrics & set(exported)]
    assert {name for q in queries for name in q.metrics} == set(exported)
    for query in queries:
        assert "strategy" in query.grouping_labels, query.expr
        found = problems(query, exported, KUBERNETES_TARGET_LABELS)
        assert not found, found


def test_a_query_on_something_nobody_exports_is_reported() -> None:
    from tests.deploy.promql import parse

    metrics = {"pd_extproc_requests_total": {"outcome", "strategy", "reason"}}
    query = parse('sum by (zone) (rate(pd_extproc_nope_total{strategy="x"}[5m]))')
    assert len(problems(query, metrics, {"job", "instance"})) == 3  # name, label, by
    query = parse('sum by (strategy) (rate(pd_extproc_requests_total{pool="x"}[5m]))')
    [problem] = problems(query, metrics, {"job", "instance"})
    assert "no label 'pool'" in problem
