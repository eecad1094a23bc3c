"""The client's own latency from Envoy's access log, the model label, and the client's trace.

Through real Envoy and vllmsim: the sidecar's time-to-first-byte and duration histograms
match what an aiohttp client measures itself, with the right strategy and model labels, also
when the entry reaches an ext_proc process other than the one that handled the request; the
client's traceparent reaches both engines unchanged and parents the sidecar's spans.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from extproc.testing import scrape
from tests.support.engines import MODEL
from tests.support.polling import until
from tests.support.topology import Topology, topology

TTFB = "pd_extproc_client_time_to_first_byte_seconds"
DURATION = "pd_extproc_client_duration_seconds"
TOLERANCE_S = 0.005
TIMED_REQUESTS = 5


def sample(name: str, suffix: str, strategy: str, model: str = MODEL, code: str = "2xx") -> str:
    return f'{name}_{suffix}{{code="{code}",model="{model}",strategy="{strategy}"}}'


class Collector:
    """An OTLP/HTTP (JSON) trace receiver on loopback: the spans the sidecar exports."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.endpoint = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._collect)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.endpoint = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1/traces"

    async def _collect(self, request: web.Request) -> web.Response:
        export = orjson.loads(await request.read())
        for resource in export["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                self.spans.extend(scope["spans"])
        return web.json_response({})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest_asyncio.fixture(scope="module")
async def collector() -> AsyncIterator[Collector]:
    collector = Collector()
    await collector.start()
    try:
        yield collector
    finally:
        await collector.stop()


@pytest_asyncio.fixture(scope="module")
async def traced(collector: Collector) -> AsyncIterator[Topology]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the sidecar exports within 0.1 s
        async with topology(tracing={"enabled": True, "endpoint": collector.endpoint}) as topo:
            await served_model_known(topo)
            yield topo


async def served_model_known(topo: Topology) -> None:
    """The identity probe has read the engines' /v1/models (the model label knows the name)."""

    async def probed() -> bool:
        return bool((await topo.ready())["identities"])

    await until(probed, "the identity probe", timeout_s=20)


async def timed_post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, float, float]:
    """(status, time to the response's first byte, time to its last), as the client sees them.

    aiohttp returns the response once its status line and headers are in: the first bytes."""
    started = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as response:
        first = time.perf_counter() - started
        await response.read()
        last = time.perf_counter() - started
    return response.status, first, last


async def observed(
    urls: list[str],
    name: str,
    strategy: str,
    model: str,
    code: str,
    count: float,
    session: aiohttp.ClientSession,
) -> float:
    """The histogram's sum over every process once its count reached `count` (polled)."""
    total: dict[str, float] = {}

    async def arrived() -> bool:
        nonlocal total
        merged: dict[str, float] = {}
        for url in urls:
            for key, value in (await scrape(session, url + "/metrics")).items():
                merged[key] = merged.get(key, 0.0) + value
        total = merged
        return merged.get(sample(name, "count", strategy, model, code), 0) >= count

    await until(arrived, f"{count:g} access-log entries for {strategy}/{model}/{code}")
    return total[sample(name, "sum", strategy, model, code)]


async def check_latency_matches(topo: Topology, strategy: str, stream: bool) -> None:
    """Requests timed by the client; each one's new observation in the metric is the same time.

    The median difference is checked: on this shared 2-core machine the client's own event
    loop is sometimes late by a few ms to notice a byte that Envoy sent on time."""
    urls = [topo.sidecar.metrics, *topo.sidecar.worker_metrics]
    url = topo.sidecar.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "latency " * 40, "max_tokens": 8, "stream": stream}
    first_diffs, last_diffs = [], []
    async with aiohttp.ClientSession() as session:
        for attempt in range(TIMED_REQUESTS + 1):  # the first one warms the connection up
            before = await scrape_counts(session, urls, strategy)
            status, first, last = await timed_post(session, url, body, {})
            assert status == 200
            ttfb = await observed(urls, TTFB, strategy, MODEL, "2xx", before[0] + 1, session)
            duration = await observed(
                urls, DURATION, strategy, MODEL, "2xx", before[1] + 1, session
            )
            if attempt:
                first_diffs.append(ttfb - before[2] - first)
                last_diffs.append(duration - before[3] - last)
    print(
        f"{strategy} stream={stream} metric - client, ms: first byte",
        [round(d * 1e3, 2) for d in first_diffs],
        "last byte",
        [round(d * 1e3, 2) for d in last_diffs],
    )
    assert abs(statistics.median(first_diffs)) <= TOLERANCE_S, first_diffs
    assert abs(statistics.median(last_diffs)) <= TOLERANCE_S, last_diffs


async def scrape_counts(
    session: aiohttp.ClientSession, urls: list[str], strategy: str
) -> tuple[float, float, float, float]:
    """(TTFB count, duration count, TTFB sum, duration sum) over every process, for MODEL."""
    merged: dict[str, float] = {}
    for url in urls:
        for key, value in (await scrape(session, url + "/metrics")).items():
            merged[key] = merged.get(key, 0.0) + value
    keys = [
        sample(TTFB, "count", strategy),
        sample(DURATION, "count", strategy),
        sample(TTFB, "sum", strategy),
        sample(DURATION, "sum", strategy),
    ]
    count_ttfb, count_duration, sum_ttfb, sum_duration = (merged.get(k, 0.0) for k in keys)
    return count_ttfb, count_duration, sum_ttfb, sum_duration


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_client_ttfb_and_duration_match_the_clients_own_timing(
    traced: Topology, stream: bool
) -> None:
    # streamed: D's headers leave when P is done, the last byte after the whole decode
    await check_latency_matches(traced, "parallel", stream)


async def test_serial_dispatch_is_labelled_serial() -> None:
    async with topology(dispatch={"mode": "serial_push"}) as topo:
        await served_model_known(topo)
        await check_latency_matches(topo, "serial", stream=False)


async def test_an_unknown_model_is_labelled_other_with_its_status(traced: Topology) -> None:
    body = {"model": "no-such-model", "prompt": "x", "max_tokens": 2}
    status, _, _ = await traced.post("/v1/completions", body)
    assert status == 404  # the engine's refusal, passed through
    urls = [traced.sidecar.metrics]
    await observed(urls, TTFB, "parallel", "other", "4xx", 1, traced.session)
    metrics = await traced.metrics()
    assert not [k for k in metrics if "no-such-model" in k]  # the label stays bounded
    # its outcome is P's or D's refusal, whichever comes first
    assert [k for k in metrics if k.startswith('pd_extproc_requests_total{model="other",')]


async def test_the_clients_traceparent_reaches_both_engines_and_parents_the_sidecar_spans(
    traced: Topology, collector: Collector
) -> None:
    await traced.clear()
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    traceparent = f"00-{trace_id}-{span_id}-01"
    body = {"model": MODEL, "prompt": "traced " * 20, "max_tokens": 4}
    status, _, _ = await traced.post(
        "/v1/completions", body, headers={"traceparent": traceparent, "tracestate": "k=v"}
    )
    assert status == 200
    [p] = await traced.seen(traced.prefills[0])
    [d] = await traced.seen(traced.decodes[0])
    assert p["headers"]["traceparent"] == d["headers"]["traceparent"] == traceparent
    assert p["headers"]["tracestate"] == d["headers"]["tracestate"] == "k=v"

    def ours() -> list[dict[str, Any]]:
        return [s for s in collector.spans if s["traceId"] == trace_id]

    async def exported() -> bool:
        return {"pd.request", "pd.prefill_leg"} <= {s["name"] for s in ours()}

    await until(exported, "the sidecar's spans in the client's trace")
    by_name = {s["name"]: s for s in ours()}
    root = by_name["pd.request"]
    assert root["parentSpanId"] == span_id  # a child of the client's span
    assert by_name["pd.prefill_leg"]["parentSpanId"] == root["spanId"]


async def test_entries_label_right_whichever_ext_proc_process_receives_them() -> None:
    """Two ext_proc processes: Envoy (one worker thread) sends every entry on one stream, to
    one process, while requests are spread over both. The labels travel in each entry, so the
    entries of the other process's requests are counted right all the same."""
    async with topology(extproc={"workers": 2}) as topo:
        assert len(topo.sidecar.worker_metrics) == 1
        workers = ("0", "1")  # the `worker` label of each process's series on the pod's page
        body = {"model": MODEL, "prompt": "workers " * 10, "max_tokens": 2}
        sent, handled = 0, [Counter[str](), Counter[str]()]
        while sent < 8 or not all(handled):  # until both processes handled some
            assert sent < 60, handled
            statuses = await asyncio.gather(*(topo.post("/v1/completions", body) for _ in range(4)))
            assert all(status == 200 for status, _, _ in statuses)
            sent += 4
            handled = [await by_strategy(topo, w, "pd_extproc_requests_total") for w in workers]

        async def all_handled() -> bool:  # a request is counted once Envoy closes its stream
            nonlocal handled
            handled = [await by_strategy(topo, w, "pd_extproc_requests_total") for w in workers]
            return (handled[0] + handled[1]).total() == sent

        await until(all_handled, f"{sent} requests counted")
        total_handled = handled[0] + handled[1]

        async def all_counted() -> bool:
            observed = [await by_strategy(topo, w, TTFB + "_count") for w in workers]
            return (observed[0] + observed[1]) == total_handled

        await until(all_counted, f"{sent} access-log entries, labelled as the requests were")
        observed = [await by_strategy(topo, w, TTFB + "_count") for w in workers]
        # entries did cross processes: one process counted requests it never saw
        assert observed != handled, (observed, handled)


async def by_strategy(topo: Topology, worker: str, name: str) -> Counter[str]:
    """The counts of `name`{model=MODEL} of one process (its `worker` label on the sidecar's
    page), by strategy (2xx/ok ones only)."""
    counts: Counter[str] = Counter()
    for key, value in (await scrape(topo.session, topo.sidecar.metrics + "/metrics")).items():
        if (
            key.startswith(name + "{")
            and f'model="{MODEL}"' in key
            and f'worker="{worker}"' in key
            and ('outcome="ok"' in key or 'code="2xx"' in key)
        ):
            counts[key.partition('strategy="')[2].partition('"')[0]] += int(value)
    return counts


async def test_pass_through_routes_send_no_entries(traced: Topology) -> None:
    """Envoy's access-log filter sends only the requests the ext_proc labelled."""
    async with traced.session.get(traced.sidecar.url + "/v1/models") as response:
        assert response.status == 200  # served by an engine, without the ext_proc
    before = await traced.metrics()
    entries = 'pd_extproc_access_log_entries_total{result="observed"}'
    body = {"model": MODEL, "prompt": "after " * 5, "max_tokens": 2}
    status, _, _ = await traced.post("/v1/completions", body)
    assert status == 200

    async def counted() -> bool:  # one stream, in order: the GET's entry would be before it
        return (await traced.metrics()).get(entries, 0) > before.get(entries, 0)

    await until(counted, "the POST's entry")
    metrics = await traced.metrics()
    assert 'pd_extproc_access_log_entries_total{result="skipped"}' not in metrics
