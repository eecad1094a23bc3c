"""What the sidecar's /metrics exposes besides its counts: no noise series, its build, buckets
that fit what each histogram measures."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from extproc.metrics import Metrics
from extproc.roles import Role


def exposed(metrics: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def observed() -> Metrics:
    metrics = Metrics()
    metrics.requests.labels("ok", "parallel", "cache_hit", "m").inc()
    metrics.client_duration_seconds.labels("parallel", "m", "2xx").observe(1500.0)
    metrics.client_first_byte_seconds.labels("parallel", "m", "2xx").observe(0.2)
    metrics.processing_seconds.observe(0.0003)
    metrics.prefill_seconds.labels("ok").observe(0.04)
    return metrics


def test_no_created_series() -> None:
    # prometheus_client's switch is process-wide (vllmsim flips it too): a process of its own
    script = (
        "from extproc.metrics import Metrics\n"
        "m = Metrics()\n"
        "m.requests.labels('ok', 'parallel', 'cache_hit', 'm').inc()\n"
        "m.client_duration_seconds.labels('parallel', 'm', '2xx').observe(1.0)\n"
        "print(m.render().decode())\n"
    )
    text = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "pd_extproc_requests_total" in names
    assert [name for name in names if name.endswith("_created")] == []


def test_build_info_names_the_version_and_python() -> None:
    [(labels, value)] = exposed(Metrics())["pd_extproc_build_info"]
    assert value == 1
    assert labels == {
        "version": importlib.metadata.version("pd-extproc"),
        "python": platform.python_version(),
    }


def buckets(metrics: Metrics, name: str) -> list[float]:
    return [float(labels["le"]) for labels, _ in exposed(metrics)[name + "_bucket"]]


def test_client_durations_reach_long_generations_and_work_keeps_sub_ms_buckets() -> None:
    metrics = observed()
    duration = buckets(metrics, "pd_extproc_client_duration_seconds")
    assert max(b for b in duration if b != float("inf")) >= 1800
    # a 25-minute generation lands in a finite bucket, not only in +Inf
    counts = dict(
        zip(
            duration,
            (v for _, v in exposed(metrics)["pd_extproc_client_duration_seconds_bucket"]),
            strict=True,
        )
    )
    assert counts[1800.0] == 1 and counts[1200.0] == 0
    assert min(buckets(metrics, "pd_extproc_processing_seconds")) <= 0.0001
    assert min(buckets(metrics, "pd_extproc_dispatch_skew_seconds")) <= 0.0001
    assert (
        max(b for b in buckets(metrics, "pd_extproc_prefill_leg_seconds") if b != float("inf"))
        >= 300
    )


def test_an_endpoints_series_come_back_after_it_left_and_returned() -> None:
    # `endpoint_health` keeps the series it looked up: a left endpoint's must be forgotten, or
    # its gauge would be set on a series no longer in the registry
    metrics = Metrics()
    metrics.endpoint_health(Role.DECODE, "10.0.0.1:8000", True)
    metrics.forget_endpoint(Role.DECODE, "10.0.0.1:8000")
    assert "pd_extproc_endpoint_healthy" not in exposed(metrics)
    metrics.endpoint_health(Role.DECODE, "10.0.0.1:8000", False)
    labels = {"role": "decode", "endpoint": "10.0.0.1:8000"}
    assert exposed(metrics)["pd_extproc_endpoint_healthy"] == [(labels, 0.0)]


def test_in_flight_counts_are_read_when_scraped() -> None:
    metrics = Metrics()
    assert "pd_extproc_inflight_requests" not in exposed(metrics)  # nothing to read yet
    counts = {"10.0.0.1:8000": 3}
    metrics.in_flight.read = lambda: [("decode", a, n) for a, n in counts.items()]
    labels = {"role": "decode", "endpoint": "10.0.0.1:8000"}
    assert exposed(metrics)["pd_extproc_inflight_requests"] == [(labels, 3.0)]
    counts["10.0.0.1:8000"] = 1  # no write: the next scrape reads it
    assert exposed(metrics)["pd_extproc_inflight_requests"] == [(labels, 1.0)]


def test_a_kept_series_is_the_one_exposed() -> None:
    metrics = Metrics()
    for _ in range(2):
        metrics.series(metrics.requests, "ok", "parallel", "cache_hit", "m").inc()
    labels = {"outcome": "ok", "strategy": "parallel", "reason": "cache_hit", "model": "m"}
    assert exposed(metrics)["pd_extproc_requests_total"] == [(labels, 2.0)]
