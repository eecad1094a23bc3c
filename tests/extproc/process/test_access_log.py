"""The AccessLogService the ext_proc serves to Envoy, over a real gRPC channel."""

from __future__ import annotations

import asyncio
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2 as entries
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf.duration_pb2 import Duration
from grpc import aio

from extproc.metrics import Metrics
from extproc.model_labels import ModelLabels
from extproc.request import envoy_msgs
from extproc.request.access_log import ClientLatency

MODELS = ModelLabels(lambda: {"m"})  # the deployment's one model


def entry(
    first_s: float | None,
    last_s: float | None,
    code: int,
    labels: dict[str, str] | None,
    reason: str | None = None,
) -> Any:
    common = entries.AccessLogCommon()
    if first_s is not None:
        common.time_to_first_downstream_tx_byte.CopyFrom(Duration(nanos=int(first_s * 1e9)))
    if last_s is not None:
        common.time_to_last_downstream_tx_byte.CopyFrom(Duration(nanos=int(last_s * 1e9)))
    if labels is not None:
        struct = envoy_msgs.request_labels((labels["strategy"], labels["model"]), reason)
        common.metadata.filter_metadata[envoy_msgs.LABELS_NAMESPACE].CopyFrom(
            struct.fields[envoy_msgs.LABELS_NAMESPACE].struct_value
        )
    log = entries.HTTPAccessLogEntry(common_properties=common)
    log.response.response_code.value = code
    return log


async def send(metrics: Metrics, *logs: Any) -> None:
    server = aio.server()
    service = ClientLatency(metrics, model_label=MODELS.known)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = als_pb2_grpc.AccessLogServiceStub(channel)
            message = als_pb2.StreamAccessLogsMessage()
            message.http_logs.log_entry.extend(logs)
            await asyncio.wait_for(stub.StreamAccessLogs(iter([message])), 5)
    finally:
        await server.stop(0)


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_entries_are_observed_under_their_labels_and_unlabelled_ones_skipped() -> None:
    metrics = Metrics()
    parallel = {"strategy": "parallel", "model": "m"}
    await send(
        metrics,
        entry(0.25, 0.75, 200, parallel),
        entry(None, None, 0, {"strategy": "serial", "model": "m"}),  # no response at all
        entry(0.5, 0.5, 404, {"strategy": "none", "model": "other"}),
        entry(0.1, 0.2, 200, None),  # a request the ext_proc never labelled
    )
    first = "pd_extproc_client_time_to_first_byte_seconds"
    duration = "pd_extproc_client_duration_seconds"
    ok = {"strategy": "parallel", "model": "m", "code": "2xx"}
    assert value(metrics, f"{first}_sum", **ok) == 0.25
    assert value(metrics, f"{duration}_sum", **ok) == 0.75
    refused = {"strategy": "none", "model": "other", "code": "4xx"}
    assert value(metrics, f"{first}_count", **refused) == 1
    assert value(metrics, f"{first}_count", strategy="serial", model="m", code="0") is None
    assert value(metrics, "pd_extproc_access_log_entries_total", result="observed") == 3
    assert value(metrics, "pd_extproc_access_log_entries_total", result="skipped") == 1


async def test_close_ends_envoys_open_streams() -> None:
    """Envoy never ends its stream: a shutdown closes it instead of waiting out the grace."""
    server = aio.server()
    service_metrics = Metrics()
    service = ClientLatency(service_metrics, model_label=MODELS.known)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    never_ends: asyncio.Queue[Any] = asyncio.Queue()

    async def messages() -> Any:
        while True:
            yield await never_ends.get()

    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(messages())
            first = als_pb2.StreamAccessLogsMessage()
            first.http_logs.log_entry.append(
                entry(0.1, 0.2, 200, {"strategy": "serial", "model": "m"})
            )
            await never_ends.put(first)
            for _ in range(200):  # the stream is open at the server (the message is counted)
                if (
                    value(service_metrics, "pd_extproc_access_log_entries_total", result="observed")
                    == 1
                ):
                    break
                await asyncio.sleep(0.01)
            service.close()
            loop = asyncio.get_running_loop()
            started = loop.time()
            await asyncio.wait_for(server.stop(30), 5)
            assert loop.time() - started < 5
            call.cancel()
    finally:
        await server.stop(0)


def answer(flag: str | None, reason: str | None = "cache_hit") -> Any:
    """A labelled 200 entry whose outcome the processor left to it (`reason` present)."""
    log = entry(0.1, 0.2, 200, None)
    struct = envoy_msgs.request_labels(("parallel", "m"), reason)
    log.common_properties.metadata.filter_metadata[envoy_msgs.LABELS_NAMESPACE].CopyFrom(
        struct.fields[envoy_msgs.LABELS_NAMESPACE].struct_value
    )
    if flag is not None:
        setattr(log.common_properties.response_flags, flag, True)
    return log


async def test_an_answer_left_to_its_entry_is_counted_by_what_envoy_saw() -> None:
    metrics = Metrics()
    await send(
        metrics,
        answer(None),
        answer("stream_idle_timeout"),  # no byte from D within kv_wait_s: its KV never came
        answer("upstream_protocol_error"),  # D's connection reset mid-stream
        answer("upstream_remote_reset"),
        answer("downstream_connection_termination"),  # the client left
        answer(None, reason=None),  # counted by the processor: not here
    )
    counts = {
        outcome: value(
            metrics,
            "pd_extproc_requests_total",
            outcome=outcome,
            strategy="parallel",
            reason="cache_hit",
            model="m",
        )
        for outcome in ("ok", "decode_timeout", "decode_reset", "cancelled")
    }
    assert counts == {"ok": 1, "decode_timeout": 1, "decode_reset": 2, "cancelled": 1}
    assert value(metrics, "pd_extproc_access_log_entries_total", result="observed") == 6


def series(metrics: Metrics) -> int:
    return sum(len(family.samples) for family in metrics.registry.collect())


async def test_entries_with_made_up_labels_never_grow_the_series() -> None:
    """Whoever reaches the access-log service writes any labels it likes: 5,000 entries with
    distinct junk strategies, reasons, models and codes land on the few known series."""
    metrics = Metrics()
    await send(metrics, entry(0.1, 0.2, 200, {"strategy": "parallel", "model": "m"}, "cache_hit"))
    before = series(metrics)
    junk = [
        entry(
            0.1,
            0.2,
            1000 * (i + 1) + 200,  # far beyond any HTTP status
            {"strategy": f"strategy-{i}", "model": f"model-{i}"},
            f"reason-{i}",
        )
        for i in range(5000)
    ]
    for start in range(0, len(junk), 500):
        await send(metrics, *junk[start : start + 500])
    observed = value(metrics, "pd_extproc_access_log_entries_total", result="observed")
    assert observed == 5001
    # one more label set per histogram and the requests counter: strategy, model, reason and
    # the code class all "other" (a histogram's set is its buckets plus _count and _sum)
    assert series(metrics) - before <= 2 * 22 + 1
    other = {"strategy": "other", "model": "other", "code": "other"}
    assert value(metrics, "pd_extproc_client_duration_seconds_count", **other) is not None
    assert len(metrics.render()) < 64 * 1024
