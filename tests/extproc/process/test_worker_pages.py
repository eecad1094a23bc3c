"""The sidecar's one metrics page over its ext_proc processes: every process's series, each
under its `worker` label, and which workers' pages came."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from extproc.metrics import Metrics
from extproc.process.worker_pages import merged_pages


def samples(page: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page.decode())
        for s in family.samples
    }


def process_page(requests: int, seconds: float) -> bytes:
    metrics = Metrics()
    metrics.requests.labels("ok", "parallel", "cache_hit", "m").inc(requests)
    metrics.processing_seconds.observe(seconds)
    return metrics.render()


def test_each_process_series_is_kept_under_its_worker_label() -> None:
    page = merged_pages([process_page(3, 0.001), process_page(5, 0.002)])
    got = samples(page)
    labels = (("model", "m"), ("outcome", "ok"), ("reason", "cache_hit"), ("strategy", "parallel"))
    assert got[("pd_extproc_requests_total", (*labels, ("worker", "0")))] == 3
    assert got[("pd_extproc_requests_total", (*labels, ("worker", "1")))] == 5
    assert got[("pd_extproc_processing_seconds_count", (("worker", "1"),))] == 1
    assert got[("pd_extproc_worker_up", (("worker", "1"),))] == 1
    # one family per name, with its type: Prometheus refuses a page that declares one twice
    assert page.count(b"# TYPE pd_extproc_requests_total counter") == 1


def test_a_worker_whose_page_did_not_come_is_marked_down() -> None:
    got = samples(merged_pages([process_page(3, 0.001), None]))
    assert got[("pd_extproc_worker_up", (("worker", "0"),))] == 1
    assert got[("pd_extproc_worker_up", (("worker", "1"),))] == 0
    assert not any(dict(labels).get("worker") == "1" for name, labels in got if "requests" in name)
