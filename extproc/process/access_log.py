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
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc.request.envoy_msgs import LABELS_NAMESPACE

if TYPE_CHECKING:
    from extproc.metrics import Metrics

__all__ = ["ClientLatency", "observe_entry"]


def _seconds(duration: Any) -> float:
    return float(duration.seconds + duration.nanos / 1e9)


def _code_class(code: int) -> str:
    """2xx, 4xx, 5xx…; "0" when no response was sent (the client or the upstream went away)."""
    return f"{code // 100}xx" if code else "0"


def observe_entry(metrics: Metrics, entry: Any) -> bool:
    """Count one HTTPAccessLogEntry; False (skipped) if it has no pd-extproc labels."""
    common = entry.common_properties
    labels = common.metadata.filter_metadata.get(LABELS_NAMESPACE)
    if labels is None:
        metrics.access_log_entries.labels("skipped").inc()
        return False
    fields = labels.fields
    strategy, model = fields["strategy"].string_value, fields["model"].string_value
    code = _code_class(entry.response.response_code.value)
    if common.HasField("time_to_first_downstream_tx_byte"):
        first = _seconds(common.time_to_first_downstream_tx_byte)
        metrics.client_first_byte_seconds.labels(strategy, model, code).observe(first)
    if common.HasField("time_to_last_downstream_tx_byte"):
        last = _seconds(common.time_to_last_downstream_tx_byte)
        metrics.client_duration_seconds.labels(strategy, model, code).observe(last)
    metrics.access_log_entries.labels("observed").inc()
    return True


class ClientLatency(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's access-log streams (one per Envoy worker thread, open for Envoy's lifetime)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._closing = asyncio.Event()

    async def StreamAccessLogs(
        self, request_iterator: Any, context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        messages = aiter(request_iterator)
        closing = asyncio.ensure_future(self._closing.wait())
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
                    observe_entry(self._metrics, entry)
        finally:
            closing.cancel()
        return als_pb2.StreamAccessLogsResponse()

    def close(self) -> None:
        """End Envoy's streams, which never end on their own, so that a shutdown need not wait
        them out. Envoy opens a new one (to another ext_proc process, when there are several)."""
        self._closing.set()
