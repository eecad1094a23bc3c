"""Every Prometheus instrument of the sidecar, declared once, on its own registry.

A registry per `Metrics` (not the global one) lets tests build many runtimes in one process.
Names follow Prometheus conventions: `pd_extproc_` prefix, base units, `_total` counters.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.roles import Role

__all__ = ["InFlightCounts", "Metrics", "package_version"]

# No `*_created` series: a counter's start time is noise on every scrape (rate() does not use
# it). The library's switch is process-wide, and this process exports only these registries.
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in the library

# Each histogram's buckets cover the range its durations live in (bucket count is what costs).
# ext_proc work and dispatch skew: 0.1 ms to 5 s.
_WORK_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    5.0,
)
# A P leg: a few ms (short prompt, idle P) to timeouts.prefill_s and beyond (a queued prefill).
_PREFILL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
# The client's first byte and whole request: a refusal in ms to a long generation (~30 min).
_CLIENT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
)


def package_version() -> str:
    """pd-extproc's version from its installed package metadata."""
    try:
        return importlib.metadata.version("pd-extproc")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


class InFlightCounts(Collector):
    """`pd_extproc_inflight_requests`, read from the pools when scraped: a gauge set at every
    change cost the request path two writes under a lock per leg. `read` gives (role,
    endpoint, count) of every member; the wiring sets it."""

    NAME = "pd_extproc_inflight_requests"
    HELP = (
        "Requests in flight per endpoint, as counted by this ext_proc: at a decode for the "
        "whole request, at a prefill while its P leg runs only."
    )

    def __init__(self) -> None:
        self.read: Callable[[], Iterable[tuple[str, str, int]]] = lambda: ()

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=["role", "endpoint"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["role", "endpoint"])
        for role, endpoint, count in self.read():
            family.add_metric([role, endpoint], count)
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # `labels()` looked up once per series (`series`, `endpoint_health`): it costs several
        # microseconds, and the request path ran it 14 times a request.
        self._series: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._endpoint_series: dict[tuple[Role, str], Any] = {}
        r = self.registry
        self.build_info = Info(
            "pd_extproc_build",
            "pd-extproc's version and the Python that runs it (always 1).",
            registry=r,
        )
        self.build_info.info({"version": package_version(), "python": platform.python_version()})
        self.requests = Counter(
            "pd_extproc_requests",
            "Client requests by what the client got (outcome: ok; client_error: the request was "
            "refused for itself, by the ext_proc, Envoy or an engine's 4xx; shed; cancelled: the "
            "client left; decode_reset / decode_timeout: D's answer was cut after its 2xx, by a "
            "reset or by no byte within timeouts.kv_wait_s; prefill_error, prefill_unreachable, "
            "prefill_timeout, prefill_listener_unreachable, identity_changed, no_healthy_prefill, "
            "no_healthy_decode, decode_4xx (408, 429), decode_5xx: a failure), by how its legs "
            "were dispatched (strategy, reason), and by model.",
            ["outcome", "strategy", "reason", "model"],
            registry=r,
        )
        # The client's side, from Envoy's access log of the ingress (`extproc.request.access_log`).
        self.client_first_byte_seconds = Histogram(
            "pd_extproc_client_time_to_first_byte_seconds",
            "Time to first byte as the client sees it: from Envoy receiving the request's "
            "first byte to Envoy sending the response's first byte (Envoy's access log).",
            ["strategy", "model", "code"],
            buckets=_CLIENT_BUCKETS,
            registry=r,
        )
        self.client_duration_seconds = Histogram(
            "pd_extproc_client_duration_seconds",
            "Request duration as the client sees it: from Envoy receiving the request's first "
            "byte to Envoy sending the response's last byte (Envoy's access log).",
            ["strategy", "model", "code"],
            buckets=_CLIENT_BUCKETS,
            registry=r,
        )
        self.access_log_entries = Counter(
            "pd_extproc_access_log_entries",
            "Envoy access-log entries received, by what was done with them: observed, or "
            "skipped (no pd-extproc labels: a request the ext_proc did not process).",
            ["result"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "pd_extproc_prefill_leg_seconds",
            "P leg latency, from sending to P's complete answer.",
            ["outcome"],
            buckets=_PREFILL_BUCKETS,
            registry=r,
        )
        self.skew_seconds = Histogram(
            "pd_extproc_dispatch_skew_seconds",
            "Parallel dispatch: |P leg leaving - decode body answer leaving Envoy's stream|.",
            buckets=_WORK_BUCKETS,
            registry=r,
        )
        self.processing_seconds = Histogram(
            "pd_extproc_processing_seconds",
            "ext_proc time per request from the body message to the body answer, "
            "not counting the wait for P in serial dispatch.",
            buckets=_WORK_BUCKETS,
            registry=r,
        )
        self.identity_events = Counter(
            "pd_extproc_identity_events",
            "Prefill identity cache transitions: learned, refreshed, changed, mismatched, "
            "dropped, flapping, restarted.",
            ["endpoint", "event"],
            registry=r,
        )
        self.in_flight = InFlightCounts()
        r.register(self.in_flight)
        self.healthy = Gauge(
            "pd_extproc_endpoint_healthy",
            "1 if the endpoint passes health checks and accepts connections, else 0.",
            ["role", "endpoint"],
            registry=r,
        )
        self.probes = Counter(
            "pd_extproc_identity_probes",
            "One-token probes sent to learn a prefill identity before user traffic.",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            "pd_extproc_dispatch_decisions",
            "Per-request decisions (decision.mode): decode_only or disaggregate, and why.",
            ["decision", "reason"],
            registry=r,
        )
        self.saturation = Gauge(
            "pd_extproc_pool_saturation",
            "Admission control: the least saturated healthy endpoint's highest load / limit "
            "ratio, per role, at the last request (1 = at the limits).",
            ["role"],
            registry=r,
        )
        self.body_bytes = Gauge(
            "pd_extproc_request_body_bytes",
            "Client request bodies this ext_proc process holds, in bytes (each until its "
            "request ends; at most limits.max_body_bytes_in_flight).",
            registry=r,
        )
        self.invalid_priorities = Counter(
            "pd_extproc_invalid_priorities",
            "Requests whose admission.priority_header was not a plain integer (served at "
            "admission.priority_default): the gateway that sets it sends something else.",
            registry=r,
        )
        self.eds_streams = Gauge(
            "pd_extproc_eds_streams",
            "Envoy EDS subscriptions to the pools' members open on this ext_proc process "
            "(0 everywhere: no Envoy follows discovery).",
            registry=r,
        )
        self.eds_responses = Counter(
            "pd_extproc_eds_responses",
            "Pool memberships sent to Envoy over EDS (sent), and those Envoy refused (rejected).",
            ["outcome"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "pd_extproc_prefill_retries",
            "Serial and pull dispatch: P legs retried on another prefill endpoint, by why.",
            ["reason"],
            registry=r,
        )

        self.decode_prompt_tokens = Gauge(
            "pd_extproc_decode_prompt_tokens",
            "Prompt tokens of each decode engine by source, as the engine reports them "
            "(vllm:prompt_tokens_by_source_total).",
            ["endpoint", "source"],
            registry=r,
        )
        self.kv_transfer_share = Gauge(
            "pd_extproc_decode_kv_transfer_share",
            "Share of a decode engine's prompt tokens that arrived by KV transfer over the "
            "last check window, deliberate decode-only requests left out (1 = real P/D; 0 = "
            "everything recomputed).",
            ["endpoint"],
            registry=r,
        )
        self.recompute_alerts = Counter(
            "pd_extproc_pd_recompute_alerts",
            "Check windows in which a decode engine recomputed prompts of disaggregated requests.",
            ["endpoint"],
            registry=r,
        )

        # The KV-cache index (extproc.kvcache): what every engine's cache holds, from its events.
        self.kv_index_blocks = Gauge(
            "pd_extproc_kv_index_blocks",
            "Blocks in the KV-cache index: (engine, block) entries, which its bound counts.",
            registry=r,
        )
        self.kv_index_bytes = Gauge(
            "pd_extproc_kv_index_bytes",
            "The KV-cache index's memory, estimated from its tables and entries.",
            registry=r,
        )
        self.kv_event_batches = Counter(
            "pd_extproc_kv_event_batches",
            "KV event batches received from an engine, by outcome: applied, replayed (applied "
            "from the replay socket), malformed (skipped), oversized (over the batch size "
            "bound, dropped).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.kv_event_gaps = Counter(
            "pd_extproc_kv_event_gaps",
            "Sequence gaps in an engine's KV events (batches lost between it and the sidecar).",
            ["endpoint"],
            registry=r,
        )
        self.kv_event_replays = Counter(
            "pd_extproc_kv_event_replays",
            "Replays asked of an engine to fill a gap, by outcome: filled, short (the engine no "
            "longer had every missing batch), failed (no answer in time, or a broken one), "
            "skipped (no replay endpoint, or the gap too long to ask for).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.kv_index_resets = Counter(
            "pd_extproc_kv_index_resets",
            "Times an engine's index entries were dropped, by why: gap (not filled by replay), "
            "restart (its sequence went back), cleared (it sent AllBlocksCleared), malformed "
            "(a batch that could not be decoded), oversized (a batch too large, dropped).",
            ["endpoint", "reason"],
            registry=r,
        )
        self.kv_event_subscriber_restarts = Counter(
            "pd_extproc_kv_event_subscriber_restarts",
            "Times an engine's KV event subscriber failed and was restarted (its index entries "
            "dropped); the log says why.",
            ["endpoint"],
            registry=r,
        )
        self.kv_event_unattributed = Counter(
            "pd_extproc_kv_event_unattributed",
            "Messages on the socket engines connect to (kv_listener) dropped unread, by why: "
            "unknown_topic (naming no pool member followed there), ambiguous_topic (naming "
            "several), wrong_sender (from an IP other than the member's it names), malformed "
            "(not a topic, a sequence number and a batch).",
            ["reason"],
            registry=r,
        )
        self.kv_routed_prompt_tokens = Counter(
            "pd_extproc_kv_routed_prompt_tokens",
            "Prompt tokens of requests routed by the KV cache, by the role they went to.",
            ["role"],
            registry=r,
        )
        self.kv_untokenized_requests = Counter(
            "pd_extproc_kv_untokenized_requests",
            "Requests of a group that routes by the KV cache sent without their token ids (so "
            "without the index), by why: queue_full, timeout, worker_died, unavailable.",
            ["reason"],
            registry=r,
        )
        self.kv_cached_prompt_tokens = Counter(
            "pd_extproc_kv_cached_prompt_tokens",
            "Of those, the leading tokens the chosen engine held (per its KV events).",
            ["role"],
            registry=r,
        )
        self.kv_event_lag_seconds = Histogram(
            "pd_extproc_kv_event_lag_seconds",
            "Age of a KV event batch when the sidecar applied it (now - the batch's timestamp).",
            buckets=_WORK_BUCKETS,  # 0.1 ms (same host) to 5 s (a stalled publisher)
            registry=r,
        )

    def series(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: only for metrics whose series are never removed and
        whose label values are bounded sets (outcomes, strategies, reasons, the bounded model
        names, code classes)."""
        key = (id(metric), labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child

    def endpoint_health(self, role: Role, address: str, healthy: bool) -> None:
        """An endpoint's health gauge; its series is kept until `forget_endpoint`."""
        key = (role, address)
        gauge = self._endpoint_series.get(key)
        if gauge is None:
            gauge = self._endpoint_series[key] = self.healthy.labels(role, address)
        gauge.set(1 if healthy else 0)

    def forget_endpoint(self, role: Role, address: str) -> None:
        """Drop the per-endpoint series of an endpoint that left its pool."""
        self._endpoint_series.pop((role, address), None)
        with contextlib.suppress(KeyError):
            self.healthy.remove(role, address)
        if role == Role.DECODE:
            with contextlib.suppress(KeyError):
                self.kv_transfer_share.remove(address)

    def forget_kv_engine(self, endpoint: str) -> None:
        """Drop the KV-event series of an engine that left the index."""
        series = {
            self.kv_event_batches: ("applied", "replayed", "malformed", "oversized"),
            self.kv_event_replays: ("filled", "short", "failed", "skipped"),
            self.kv_index_resets: ("gap", "restart", "cleared", "malformed", "oversized"),
        }
        for counter, values in series.items():
            for value in values:
                with contextlib.suppress(KeyError):
                    counter.remove(endpoint, value)
        for counter in (self.kv_event_gaps, self.kv_event_subscriber_restarts):
            with contextlib.suppress(KeyError):
                counter.remove(endpoint)

    def render(self) -> bytes:
        return generate_latest(self.registry)
