"""The client's own latency, from Envoy's access log of the ingress (gRPC AccessLogService).

Envoy streams an entry per finished client request to the ext_proc (the `http_grpc` access
logger on the ingress connection manager, pointed at the ext_proc's cluster). Each entry has
Envoy's timings as seen from the client's side of Envoy: time to the response's first byte
and to its last, counted from the request's first byte. The response body is never buffered
or seen: Envoy measures, the ext_proc only counts.

The entry also carries the request's labels (strategy, model), which the ext_proc wrote into
the stream's dynamic metadata when it answered (`envoy_msgs.request_labels`). The join to the
request is thus done by Envoy, per entry: with several ext_proc processes, an entry labels
the metric correctly whichever process receives it, and no table of pending requests is kept.
An entry without those labels is a request the ext_proc did not process (a pass-through
route); Envoy's access-log filter leaves such entries out, and any that arrive are skipped.

Outcomes. Once D's 2xx headers have passed, only Envoy knows whether the client got the whole
answer: a D that resets, or sends nothing for timeouts.kv_wait_s (its KV never arrived), cuts a
stream the client already has a 200 for, and the ext_proc's stream ends the same way in every
case. So while Envoy streams its access log to this process (`AccessLogStreams`), the processor
leaves such a request's `pd_extproc_requests_total` to its entry (it writes the dispatch's
`reason` into the labels to say so), and `answer_outcome` reads Envoy's response flags. Without
an access log (an Envoy without the logger, `access_log.enabled: false`) the processor counts
it itself, as `ok`.

Anyone who reaches the access-log service could write any labels into an entry, so every label
value is checked against the values the ext_proc itself writes (`bounded`): an unknown one is
counted as "other", and the number of series stays fixed whatever the entries say.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc.errors import KvLost
from extproc.request.envoy_msgs import LABELS_NAMESPACE
from extproc.request.plan import Strategy

if TYPE_CHECKING:
    from extproc.metrics import Metrics

__all__ = [
    "OTHER",
    "REASONS",
    "STRATEGIES",
    "AccessLogStreams",
    "ClientLatency",
    "answer_outcome",
    "bounded",
    "observe_entry",
]

OTHER = "other"  # a label value the ext_proc never writes
# The labels the processor writes (`envoy_msgs.request_labels`): a plan's strategy, or "none"
# for a request refused before it was planned; a dispatch's reason (`request.plan`,
# `scheduling.decision`, `scheduling.scheduler`, the endpoint picker's pass-through).
STRATEGIES = frozenset({*(str(s) for s in Strategy), "none"})
REASONS = frozenset(
    {
        "none",
        "cache_hit",
        "cache_miss",
        "pull",
        "serial_only",
        "no_prefill",
        "passthrough",
        "short_prompt",
        "long_prompt",
        "kv_pressure",
        "faster_pd",
        "stall_budget",
        "faster_alone",
    }
)
_CODE_CLASSES = frozenset({"0", "1xx", "2xx", "3xx", "4xx", "5xx"})


class AccessLogStreams:
    """Whether Envoy streams its access log to this process, so that an answer's outcome can
    be left to its entry; and how many such requests this process still awaits (a count that
    is exact with one process: with several, an entry may reach another)."""

    def __init__(self) -> None:
        self.open = 0  # Envoy's access-log streams to this process
        self.awaiting = 0  # requests ended here whose entry has not been counted here

    @property
    def decide_outcomes(self) -> bool:
        return self.open > 0


# What the ext_proc may say of an answer it cut itself (a bounded set, whatever an entry holds)
_TOLD_OUTCOMES = frozenset({KvLost.label})


def answer_outcome(entry: Any) -> str:
    """What the client got of an answer whose 2xx headers had passed: all of it (ok), or a
    stream Envoy cut (its response flags say why)."""
    flags = entry.common_properties.response_flags
    if flags.downstream_connection_termination:
        return "cancelled"  # the client went away first
    if flags.stream_idle_timeout:
        return "decode_timeout"  # nothing from D within timeouts.kv_wait_s: KV never came
    if flags.ListFields():
        return "decode_reset"  # D reset or dropped the stream, or another upstream failure
    return "ok"


def _seconds(duration: Any) -> float:
    return float(duration.seconds + duration.nanos / 1e9)


def bounded(value: str, known: frozenset[str]) -> str:
    return value if value in known else OTHER


def _code_class(code: int) -> str:
    """2xx, 4xx, 5xx…; "0" when no response was sent (the client or the upstream went away)."""
    return bounded(f"{code // 100}xx" if code else "0", _CODE_CLASSES)


def _field(fields: Any, key: str) -> str:
    value = fields.get(key)
    return value.string_value if value is not None else ""


def observe_entry(
    metrics: Metrics,
    entry: Any,
    streams: AccessLogStreams | None = None,
    model_label: Callable[[str], str] | None = None,
) -> bool:
    """Count one HTTPAccessLogEntry (and the request's outcome, when the processor left it to
    the entry); False (skipped) if it has no pd-extproc labels. `model_label` bounds the model
    to the names the deployment knows (`extproc.model_labels`; None: every model is "other")."""
    common = entry.common_properties
    labels = common.metadata.filter_metadata.get(LABELS_NAMESPACE)
    if labels is None:
        metrics.series(metrics.access_log_entries, "skipped").inc()
        return False
    fields = labels.fields
    strategy = bounded(_field(fields, "strategy"), STRATEGIES)
    model = model_label(_field(fields, "model")) if model_label is not None else OTHER
    code = _code_class(entry.response.response_code.value)
    if "reason" in fields:
        # "outcome": the ext_proc cut the answer itself (its push was lost) and says why
        told = fields["outcome"].string_value if "outcome" in fields else None
        outcome = told if told in _TOLD_OUTCOMES else answer_outcome(entry)
        reason = bounded(_field(fields, "reason"), REASONS)
        metrics.series(metrics.requests, outcome, strategy, reason, model).inc()
        if streams is not None and streams.awaiting > 0:  # an entry of another process: not ours
            streams.awaiting -= 1
    if common.HasField("time_to_first_downstream_tx_byte"):
        first = _seconds(common.time_to_first_downstream_tx_byte)
        metrics.series(metrics.client_first_byte_seconds, strategy, model, code).observe(first)
    if common.HasField("time_to_last_downstream_tx_byte"):
        last = _seconds(common.time_to_last_downstream_tx_byte)
        metrics.series(metrics.client_duration_seconds, strategy, model, code).observe(last)
    metrics.series(metrics.access_log_entries, "observed").inc()
    return True


class ClientLatency(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's access-log streams (one per Envoy worker thread, open for Envoy's lifetime)."""

    def __init__(
        self,
        metrics: Metrics,
        streams: AccessLogStreams | None = None,
        model_label: Callable[[str], str] | None = None,
    ) -> None:
        self._metrics = metrics
        self.streams = AccessLogStreams() if streams is None else streams
        self._model_label = model_label
        self._closing = asyncio.Event()

    async def StreamAccessLogs(
        self, request_iterator: Any, context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        messages = aiter(request_iterator)
        closing = asyncio.ensure_future(self._closing.wait())
        self.streams.open += 1
        try:
            while True:
                read = asyncio.ensure_future(anext(messages, None))
                await asyncio.wait({read, closing}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():  # shutting down: answer, which ends the call at once
                    read.cancel()
                    break
                message = read.result()
                if message is None:  # Envoy closed its stream
                    break
                for entry in message.http_logs.log_entry:
                    observe_entry(self._metrics, entry, self.streams, self._model_label)
        finally:
            self.streams.open -= 1
            closing.cancel()
        return als_pb2.StreamAccessLogsResponse()

    def close(self) -> None:
        """End Envoy's streams, which never end on their own, so that a shutdown need not wait
        them out. Envoy opens a new one (to another ext_proc process, when there are several)."""
        self._closing.set()
