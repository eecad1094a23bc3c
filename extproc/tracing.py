"""Optional OpenTelemetry spans per request (off by default; `pip install 'pd-extproc[otel]'`).

Spans go out as OTLP/HTTP with JSON bodies, which every OTLP collector accepts; the protobuf
exporter would need `opentelemetry-proto`, an older copy of which ships inside `xds-protos`.

Each client request becomes a `pd.request` span with the dispatch decision and outcome, and
two children: `pd.prefill_leg` (from the P leg leaving to P's answer: P's queue + prefill) and
`pd.decode_first_response` (from the decode body answer to D's response headers). For a
non-streaming request the latter covers the transfer wait and the whole decode; a streaming
vLLM sends its headers at once, so there it only shows D accepting the request. The sidecar
does not see response bodies, so the first token itself is not observed (the client's time to
first byte is a metric instead, from Envoy's access log).

A client that sends a W3C `traceparent` gets `pd.request` as a child of its span, so the
sidecar's spans join the client's trace. Both legs carry the client's `traceparent` unchanged
(`dispatch.forward_headers` for P; Envoy passes it to D), so the engines' spans join it too.

`RequestTrace` is a null object when tracing is off, so the processor never checks for it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extproc.config import TracingConfig

__all__ = ["RequestTrace", "Tracing"]


class RequestTrace:
    """What the processor reports; this base class does nothing (tracing off)."""

    def join_client(self, traceparent: str | None, tracestate: str | None) -> None:
        """The client's trace context, from its headers (before any other call)."""

    def prefill_started(self) -> None: ...
    def prefill_finished(self, outcome: str) -> None: ...
    def decode_started(self) -> None: ...
    def decode_answered(self, status: int) -> None: ...
    def finish(self, fields: dict[str, Any]) -> None: ...


class _SpanTrace(RequestTrace):
    """The root span starts when the stream opens; it is created once its parent is known."""

    def __init__(self, tracer: Any, trace_api: Any, propagator: Any) -> None:
        self._tracer = tracer
        self._trace_api = trace_api
        self._propagator = propagator
        self._started_ns = time.time_ns()
        self._root: Any = None
        self._context: Any = None
        self._prefill: Any = None
        self._decode: Any = None

    def join_client(self, traceparent: str | None, tracestate: str | None) -> None:
        carrier = {"traceparent": traceparent or "", "tracestate": tracestate or ""}
        self._start_root(self._propagator.extract(carrier) if traceparent else None)

    def _start_root(self, parent: Any) -> None:
        """The `pd.request` span, a child of `parent` (the client's context) or a new trace."""
        self._root = self._tracer.start_span(
            "pd.request", context=parent, start_time=self._started_ns
        )
        self._context = self._trace_api.set_span_in_context(self._root)

    def _child(self, name: str) -> Any:
        if self._root is None:
            self._start_root(None)
        return self._tracer.start_span(name, context=self._context)

    def prefill_started(self) -> None:
        self._prefill = self._child("pd.prefill_leg")

    def prefill_finished(self, outcome: str) -> None:
        if self._prefill is not None:
            self._prefill.set_attribute("pd.outcome", outcome)
            self._prefill.end()
            self._prefill = None

    def decode_started(self) -> None:
        self._decode = self._child("pd.decode_first_response")

    def decode_answered(self, status: int) -> None:
        if self._decode is not None:
            self._decode.set_attribute("http.response.status_code", status)
            self._decode.end()
            self._decode = None

    def finish(self, fields: dict[str, Any]) -> None:
        if self._root is None:
            self._start_root(None)
        for span in (self._prefill, self._decode):
            if span is not None:
                span.end()
        for key, value in fields.items():
            if value is not None:
                self._root.set_attribute(f"pd.{key}", value)
        self._root.end()


class Tracing:
    """Builds a RequestTrace per request: spans exported over OTLP/HTTP, or nothing."""

    def __init__(self, config: TracingConfig) -> None:
        self._tracer: Any = None
        self._provider: Any = None
        if config.enabled:
            self._setup(config)

    def _setup(self, config: TracingConfig) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            raise RuntimeError(
                "tracing.enabled needs OpenTelemetry: pip install 'pd-extproc[otel]'"
            ) from None
        provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        # The batch processor exports from its own thread: the event loop never waits on it.
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
        self._provider, self._trace_api = provider, trace
        self._propagator = TraceContextTextMapPropagator()  # W3C traceparent / tracestate
        self._tracer = provider.get_tracer("pd-extproc")

    def request(self) -> RequestTrace:
        if self._tracer is None:
            return RequestTrace()
        return _SpanTrace(self._tracer, self._trace_api, self._propagator)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
