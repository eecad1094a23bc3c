"""The sidecar's spans join the client's trace (W3C traceparent), with the OpenTelemetry SDK."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from extproc.tracing import _SpanTrace


@pytest.fixture
def spans() -> Any:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    def run(traceparent: str | None, join: bool = True) -> dict[str, Any]:
        request = _SpanTrace(tracer, trace, TraceContextTextMapPropagator())
        if join:
            request.join_client(traceparent, "k=v" if traceparent else None)
        request.prefill_started()
        request.prefill_finished("ok")
        request.finish({"outcome": "ok"})
        finished = {span.name: span for span in exporter.get_finished_spans()}
        exporter.clear()
        return finished

    yield run
    provider.shutdown()


def test_the_request_span_is_a_child_of_the_clients_span(spans: Any) -> None:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    finished = spans(f"00-{trace_id}-{span_id}-01")
    root = finished["pd.request"]
    assert root.parent is not None and root.parent.span_id == int(span_id, 16)
    assert root.context.trace_id == int(trace_id, 16)
    assert root.context.trace_state.get("k") == "v"
    assert finished["pd.prefill_leg"].parent.span_id == root.context.span_id


@pytest.mark.parametrize("traceparent", [None, "00-not-a-trace-01", "garbage"])
def test_without_a_valid_traceparent_the_request_starts_its_own_trace(
    spans: Any, traceparent: str | None
) -> None:
    finished = spans(traceparent)
    assert finished["pd.request"].parent is None
    assert finished["pd.prefill_leg"].parent.span_id == finished["pd.request"].context.span_id


def test_a_request_that_ended_before_its_headers_still_has_its_span(spans: Any) -> None:
    finished = spans(None, join=False)
    assert finished["pd.request"].parent is None
    assert finished["pd.request"].attributes["pd.outcome"] == "ok"
