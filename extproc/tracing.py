"""Optional OpenTelemetry spans per request (off by default; `pip install 'pd-extproc[otel]'`).

Spans go out as OTLP/HTTP with JSON bodies, which every OTLP collector accepts; the protobuf
exporter would need `opentelemetry-proto`, an older copy of which ships inside `xds-protos`.

Each client request becomes a `pd.request` span with the dispatch decision and outcome, and
two children: `pd.prefill_leg` (from the P leg leaving to P's answer: P's queue + prefill) and
`pd.decode_first_response` (from the decode body answer to D's response headers). For a
non-streaming request the latter covers the transfer wait and the whole decode; a streaming
vLLM sends its headers at once, so there it only shows D accepting the request. The sidecar
does not see response bodies, so the first token itself is not observed.

`RequestTrace` is a null object when tracing is off, so the processor never checks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extproc.config import TracingConfig

__all__ = ["RequestTrace", "Tracing"]


class RequestTrace:
    """What the processor reports; this base class does nothing (tracing off)."""

    def prefill_started(self) -> None: ...
    def prefill_finished(self, outcome: str) -> None: ...
    def decode_started(self) -> None: ...
    def decode_answered(self, status: int) -> None: ...
    def finish(self, fields: dict[str, Any]) -> None: ...


class _SpanTrace(RequestTrace):
    def __init__(self, tracer: Any, trace_api: Any) -> None:
        self._tracer = tracer
        self._root = tracer.start_span("pd.request")
        self._context = trace_api.set_span_in_context(self._root)
        self._prefill: Any = None
        self._decode: Any = None

    def prefill_started(self) -> None:
        self._prefill = self._tracer.start_span("pd.prefill_leg", context=self._context)

    def prefill_finished(self, outcome: str) -> None:
        if self._prefill is not None:
            self._prefill.set_attribute("pd.outcome", outcome)
            self._prefill.end()
            self._prefill = None

    def decode_started(self) -> None:
        self._decode = self._tracer.start_span("pd.decode_first_response", context=self._context)

    def decode_answered(self, status: int) -> None:
        if self._decode is not None:
            self._decode.set_attribute("http.response.status_code", status)
            self._decode.end()
            self._decode = None

    def finish(self, fields: dict[str, Any]) -> None:
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
        except ImportError:
            raise RuntimeError(
                "tracing.enabled needs OpenTelemetry: pip install 'pd-extproc[otel]'"
            ) from None
        provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}))
        # The batch processor exports from its own thread: the event loop never waits on it.
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
        self._provider, self._trace_api = provider, trace
        self._tracer = provider.get_tracer("pd-extproc")

    def request(self) -> RequestTrace:
        return RequestTrace() if self._tracer is None else _SpanTrace(self._tracer, self._trace_api)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
