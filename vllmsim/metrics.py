"""Prometheus instruments with vLLM's names, one registry per engine generation.

A simulated restart builds a fresh `Metrics`, which resets every counter and moves
``process_start_time_seconds``, as a real process restart would. Each data-parallel rank has
its own, labelled `engine="<rank>"` as vLLM labels its per-engine series; `render` merges them
into one page.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

disable_created_metrics()  # type: ignore[no-untyped-call]  # vLLM has no *_created series either

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)

# vLLM's TTFT buckets (v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")
TOKEN_SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")


class Metrics:
    def __init__(self, model_name: str, start_time: float | None = None, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        self.start_time = start_time if start_time is not None else time.time()
        labels = ["model_name", "engine"]
        self._labels = {"model_name": model_name, "engine": engine}
        reg = self.registry
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the batch", labels, registry=reg
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", labels, registry=reg)
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason",
            [*labels, "reason"],
            registry=reg,
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage (0-1)", labels, registry=reg
        )
        self.fetch_by_stage = Gauge(
            "vllm:num_requests_kv_fetch_by_stage",
            "Consumer requests by KV fetch stage",
            [*labels, "stage"],
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed", labels, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed", labels, registry=reg
        )
        self.prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            labels,
            registry=reg,
        )
        self.prompt_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where they came from",
            [*labels, "source"],
            registry=reg,
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=reg,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=reg,
        )
        self.nixl_xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds", "NIXL transfer time", labels, registry=reg
        )
        self.nixl_bytes = Counter(
            "vllm:nixl_bytes_transferred", "Bytes moved by NIXL", labels, registry=reg
        )
        self.nixl_failed_transfers = Counter(
            "vllm:nixl_num_failed_transfers", "Failed NIXL transfers", labels, registry=reg
        )
        self.nixl_failed_notifs = Counter(
            "vllm:nixl_num_failed_notifications",
            "Failed NIXL notifications",
            labels,
            registry=reg,
        )
        self.nixl_expired = Counter(
            "vllm:nixl_num_kv_expired_reqs",
            "P requests whose KV lease expired",
            labels,
            registry=reg,
        )
        self.process_start = Gauge(
            "process_start_time_seconds",
            "Start time of the process since unix epoch",
            registry=reg,
        )
        self.process_start.set(self.start_time)
        for m in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.ttft,
            self.prompt_tokens,
            self.generation_tokens,
            self.prompt_tokens_cached,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.nixl_xfer_time,
            self.nixl_bytes,
            self.nixl_failed_transfers,
            self.nixl_failed_notifs,
            self.nixl_expired,
        ):
            m.labels(**self._labels)
        for source in TOKEN_SOURCES:  # export zeros so scrapers see every series
            self.prompt_by_source.labels(**self._labels, source=source)
        for stage in FETCH_STAGES:
            self.fetch_by_stage.labels(**self._labels, stage=stage)

    def lbl(self, metric: _Metric, **extra: str) -> _Metric:
        return metric.labels(**self._labels, **extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Merged:
    """The ranks' registries as one: each family once, every rank's samples in it. The
    unlabelled process start time is the API server's: the earliest of the ranks'."""

    def __init__(self, registries: Iterable[CollectorRegistry]) -> None:
        self._registries = list(registries)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for registry in self._registries:
            for family in registry.collect():
                known = merged.get(family.name)
                if known is None:
                    merged[family.name] = family
                elif family.samples and not family.samples[0].labels:
                    first, other = known.samples[0], family.samples[0]
                    known.samples = [min(first, other, key=lambda sample: sample.value)]
                else:
                    known.samples.extend(family.samples)
        yield from merged.values()


def render(ranks: Iterable[Metrics]) -> bytes:
    """One exposition page for every rank's metrics."""
    return generate_latest(_Merged(m.registry for m in ranks))
