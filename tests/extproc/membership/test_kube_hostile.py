"""Kubernetes discovery against a broken or hostile API server (tests/support/kube_api.py):
malformed objects are skipped with one warning each and stop nothing, bad target ports are
refused at the source, a watch answered at once with nothing is re-opened with a growing pause,
and thousands of pods and bursts of events cost per event, not per event times pods."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from extproc.config import DiscoveryConfig, parse_config, parse_host_port
from extproc.membership.discovery import Discovery
from extproc.membership.eds import Memberships, pool_cluster_name
from extproc.roles import Role
from tests.support.kube_api import FakeKubeApi, fake_kube_api, inference_pool, pod
from tests.support.polling import until_true

ROLE = "llm-d.ai/role"
PREFILL = {"app": "vllm", "tier": "prefill", ROLE: "prefill"}
DECODE = {"app": "vllm", ROLE: "decode"}


class Sink:
    """The discovery's sink, into a real Memberships (what EDS serves) whose changes (the
    pushes every EDS stream makes) are counted."""

    def __init__(self) -> None:
        self.members: dict[Role, list[str]] = {Role.PREFILL: [], Role.DECODE: []}
        self.memberships = Memberships()
        self.pushes = 0

    def set_group_members(self, model: str, role: Role, members: list[str]) -> None:
        pass

    def set_members(self, role: Role, members: list[str]) -> None:
        self.members[role] = sorted(members)
        before = self.memberships.get(pool_cluster_name(role))
        self.memberships.publish(pool_cluster_name(role), members)
        self.pushes += self.memberships.get(pool_cluster_name(role)) != before


@pytest_asyncio.fixture
async def kube(tmp_path: Path) -> AsyncIterator[tuple[FakeKubeApi, dict[str, Any]]]:
    token = tmp_path / "token"
    token.write_text("token-1\n")
    async with fake_kube_api() as fake:
        settings = DiscoveryConfig(
            kubernetes_api=fake.url, token_file=str(token), ca_file="/nonexistent"
        )
        yield fake, settings.model_dump()


@pytest_asyncio.fixture
async def discovery(
    kube: tuple[FakeKubeApi, dict[str, Any]],
) -> AsyncIterator[tuple[FakeKubeApi, Discovery, Sink]]:
    """Prefill by label selector, decode from the InferencePool "llama" (both see every pod)."""
    fake, settings = kube
    config = parse_config(
        {
            "prefill": {"kubernetes": {"label_selector": "tier=prefill", "port": 8000}},
            "decode": {"inference_pool": {"name": "llama"}},
            "discovery": settings,
        }
    )
    sink = Sink()
    found = Discovery(sink, lambda: config)
    try:
        yield fake, found, sink
    finally:
        await found.stop()


def _broken(change: str) -> Any:
    """A pod with one thing wrong (or a whole object that is no pod)."""
    good = pod("broken", "10.0.0.66", {**PREFILL, ROLE: "decode"})  # in both pools if sound
    bad = copy.deepcopy(good)
    status, metadata = bad["status"], bad["metadata"]
    match change:
        case "ip 999.1.1.1":
            status["podIP"] = "999.1.1.1"
        case "ip as a number":
            status["podIP"] = 167772161
        case "ip with a zone":
            status["podIP"] = "fe80::1%eth0"
        case "conditions as an object":
            status["conditions"] = {"type": "Ready", "status": "True"}
        case "a condition as a string":
            status["conditions"] = ["Ready"]
        case "phase as a list":
            status["phase"] = ["Running"]
        case "labels as a list":
            metadata["labels"] = ["app=vllm"]
        case "a label value as a number":
            metadata["labels"] = {**metadata["labels"], "tier": 7}
        case "status as a string":
            bad["status"] = "Running"
        case "no status":
            del bad["status"]
        case "metadata as a string":
            bad["metadata"] = "broken"
        case "no name":
            del metadata["name"]
        case "not an object":
            bad = ["a", "list"]
    return bad


MALFORMED = [
    "ip 999.1.1.1",
    "ip as a number",
    "ip with a zone",
    "conditions as an object",
    "a condition as a string",
    "phase as a list",
    "labels as a list",
    "a label value as a number",
    "status as a string",
    "no status",
    "metadata as a string",
    "no name",
    "not an object",
]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "malformed" in r.getMessage()
    ]


@pytest.mark.parametrize("change", MALFORMED)
async def test_a_malformed_pod_is_skipped_once_and_stops_nothing(
    discovery: tuple[FakeKubeApi, Discovery, Sink],
    change: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, found, sink = discovery
    caplog.set_level(logging.INFO, "extproc.membership.discovery")
    fake.put_pod(pod("p-0", "10.0.0.1", PREFILL))
    fake.put_pod(pod("d-0", "10.0.0.2", DECODE))
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 8000))
    fake.put_raw("pods", "broken", _broken(change))  # to both watches, selector or not
    await found.refresh()  # the start: it must not fail
    assert sink.members == {Role.PREFILL: ["10.0.0.1:8000"], Role.DECODE: ["10.0.0.2:8000"]}
    fake.put_raw("pods", "broken", _broken(change))  # the same object, another event
    fake.put_pod(pod("p-1", "10.0.0.3", PREFILL))  # both pools still follow their pods
    fake.put_pod(pod("d-1", "10.0.0.4", DECODE))
    await until_true(lambda: len(sink.members[Role.DECODE]) == 2, "d-1 after the bad pod")
    await until_true(lambda: len(sink.members[Role.PREFILL]) == 2, "p-1 after the bad pod")
    warned = _warnings(caplog)
    assert len(warned) == 1, warned  # one line for the object: not per event, not per watch
    assert "skipped, malformed" in warned[0]
    assert "10.0.0.66" not in str(sink.members)


async def test_a_pod_turned_malformed_leaves_and_returns_once_fixed(
    discovery: tuple[FakeKubeApi, Discovery, Sink], caplog: pytest.LogCaptureFixture
) -> None:
    fake, found, sink = discovery
    caplog.set_level(logging.INFO, "extproc.membership.discovery")
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 8000))
    fake.put_pod(pod("d-0", "10.0.0.2", DECODE))
    await found.refresh()
    assert sink.members[Role.DECODE] == ["10.0.0.2:8000"]
    fake.put_pod(pod("d-0", "10.0.0.2.5", DECODE))
    await until_true(lambda: sink.members[Role.DECODE] == [], "the malformed pod to leave")
    fake.put_pod(pod("d-0", "10.0.0.2", DECODE))
    await until_true(lambda: sink.members[Role.DECODE] == ["10.0.0.2:8000"], "it to return")
    fake.put_pod(pod("d-0", "10.0.0.2.5", DECODE))  # malformed again: a new streak, a new line
    await until_true(lambda: sink.members[Role.DECODE] == [], "the malformed pod to leave")
    assert len(_warnings(caplog)) == 2


@pytest.mark.parametrize(
    "spec",
    [
        {"selector": "app=vllm", "targetPorts": [{"number": 8000}]},
        {"targetPorts": {"number": 8000}},
    ],
    ids=["selector as a string", "targetPorts as an object"],
)
async def test_a_malformed_inference_pool_has_no_members_until_fixed(
    discovery: tuple[FakeKubeApi, Discovery, Sink],
    caplog: pytest.LogCaptureFixture,
    spec: dict[str, Any],
) -> None:
    fake, found, sink = discovery
    caplog.set_level(logging.INFO, "extproc.membership.discovery")
    fake.put_pod(pod("p-0", "10.0.0.1", PREFILL))
    fake.put_pod(pod("d-0", "10.0.0.2", DECODE))
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 8000) | {"spec": spec})
    await found.refresh()
    assert sink.members == {Role.PREFILL: ["10.0.0.1:8000"], Role.DECODE: []}
    warned = _warnings(caplog)
    assert len(warned) == 1 and "inferencepools default/llama" in warned[0], warned
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 8000))
    await until_true(lambda: sink.members[Role.DECODE] == ["10.0.0.2:8000"], "the fixed pool")


@pytest.mark.parametrize(
    ("ports", "members"),
    [
        ([70000, 8000], ["10.0.0.2:8000"]),
        ([-5, 0, 8000, 8000], ["10.0.0.2:8000"]),
        (["8000", True, None, 8001], ["10.0.0.2:8001"]),
        ([70000], []),
    ],
    ids=["70000", "negative", "wrong types", "none left"],
)
async def test_bad_target_ports_are_refused_at_the_source(
    discovery: tuple[FakeKubeApi, Discovery, Sink],
    caplog: pytest.LogCaptureFixture,
    ports: list[Any],
    members: list[str],
) -> None:
    fake, found, sink = discovery
    caplog.set_level(logging.INFO, "extproc.membership.discovery")
    fake.put_pod(pod("p-0", "10.0.0.1", PREFILL))
    fake.put_pod(pod("d-0", "10.0.0.2", DECODE))
    pool = inference_pool("llama", {"app": "vllm"}, 8000)
    pool["spec"]["targetPorts"] = [{"number": port} for port in ports]
    fake.put_pool(pool)
    await found.refresh()
    assert sink.members[Role.DECODE] == members
    assert sink.members[Role.PREFILL] == ["10.0.0.1:8000"]  # the other pool is untouched
    for role in Role:  # what EDS hands Envoy: every member a valid host:port
        for member in sink.memberships.get(pool_cluster_name(role)) or ():
            parse_host_port(member)
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1, refused
    fake.put_pool(pool)  # the same pool again: no second line
    fake.put_pod(pod("p-1", "10.0.0.3", PREFILL))
    await until_true(lambda: len(sink.members[Role.PREFILL]) == 2, "p-1")
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("mode", "warning"),
    [
        ("empty", "without an event"),
        ("closed", "without an event"),
        ("garbage", "a watch event that is not an object"),
    ],
)
async def test_a_watch_that_ends_at_once_is_reopened_with_a_growing_pause(
    kube: tuple[FakeKubeApi, dict[str, Any]],
    mode: str,
    warning: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, settings = kube
    caplog.set_level(logging.INFO, "extproc.membership.discovery")
    decode = {"kubernetes": {"label_selector": "app=vllm", "port": 8000}}
    config = parse_config(
        {"prefill": {"endpoints": ["10.0.9.9:8000"]}, "decode": decode, "discovery": settings}
    )
    sink = Sink()
    found = Discovery(sink, lambda: config)
    fake.watch_mode = mode
    try:
        await found.refresh()
        await until_true(lambda: len(fake.watches("pods")) >= 1, "the first watch")
        # The pauses double from 1 s (0.5 s first, each within +-20 %): at most two re-opens
        # in 1.5 s however fast the server answers (with no pause: thousands).
        await asyncio.sleep(1.5)  # the window observed, not a synchronisation
        assert len(fake.watches("pods")) <= 3, len(fake.watches("pods"))
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and warning in warned[0], warned
        fake.watch_mode = ""  # the server is sound again: a watch delivers, the pause resets
        fake.put_pod(pod("a", "10.0.0.1", {"app": "vllm"}))
        await until_true(lambda: sink.members[Role.DECODE] == ["10.0.0.1:8000"], "the pod")
        assert any("watching again" in r.getMessage() for r in caplog.records)
        assert len(fake.lists("pods")) == 1  # resumed from its version all along
    finally:
        await found.stop()


async def test_thousands_of_pods_and_bursts_cost_per_event(
    kube: tuple[FakeKubeApi, dict[str, Any]],
) -> None:
    """3,000 pods of one InferencePool (both roles) arrive as events, then 300 change at once:
    each event is one pod's work per pool that uses it (not every pod's), and the sink (and
    so each EDS stream) hears of a burst a few times, not once per event."""
    fake, settings = kube
    source = {"inference_pool": {"name": "llama"}}
    config = parse_config({"prefill": source, "decode": source, "discovery": settings})
    sink = Sink()
    found = Discovery(sink, lambda: config)
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 8000))
    try:
        await found.refresh()
        start, published = found.evaluations, found.publishes
        pods = 3000
        for i in range(pods):
            labels = PREFILL if i % 2 else DECODE
            fake.put_pod(pod(f"pod-{i}", f"10.1.{i // 250}.{i % 250}", labels))
        await until_true(
            lambda: len(sink.members[Role.PREFILL]) + len(sink.members[Role.DECODE]) == pods,
            "3,000 pods",
            timeout_s=60,
        )
        assert found.evaluations - start == 2 * pods  # each pod once for each pool
        assert found.publishes - published <= pods // 10
        assert sink.pushes <= pods // 10

        events = 300  # as many pods move to a new IP at once (half prefill, half decode)
        start, published, pushes = found.evaluations, found.publishes, sink.pushes
        for i in range(events):
            labels = PREFILL if i % 2 else DECODE
            fake.put_pod(pod(f"pod-{i}", f"10.2.{i // 250}.{i % 250}", labels))

        def moved() -> int:
            return sum(m.startswith("10.2.") for role in Role for m in sink.members[role])

        await until_true(lambda: moved() == events, "the burst", timeout_s=60)
        assert found.evaluations - start == 2 * events
        assert found.publishes - published <= events // 10
        assert sink.pushes - pushes <= events // 10
    finally:
        await found.stop()


async def test_a_stream_of_events_is_told_once_it_pauses_not_every_few_events(
    kube: tuple[FakeKubeApi, dict[str, Any]],
) -> None:
    """2,000 changes arriving over a few hundred ms, never 50 ms apart: the sink (and every EDS
    stream) hears of them about once (each telling costs the whole pool), not every 50 ms."""
    fake, settings = kube
    source = {"inference_pool": {"name": "llama"}}
    config = parse_config({"prefill": source, "decode": source, "discovery": settings})
    sink = Sink()
    found = Discovery(sink, lambda: config)
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 8000))
    pods, events, slice_size = 100, 2000, 50
    for i in range(pods):
        fake.put_pod(pod(f"pod-{i}", f"10.1.0.{i}", PREFILL if i % 2 else DECODE))
    try:
        await found.refresh()
        published, pushes = found.publishes, sink.pushes
        for i in range(events):
            j = i % pods
            fake.put_pod(pod(f"pod-{j}", f"10.{2 + i // pods}.0.{j}", PREFILL if j % 2 else DECODE))
            if i % slice_size == slice_size - 1:
                await asyncio.sleep(0.01)  # the next events come soon, in under 50 ms
        last = f"10.{1 + events // pods}.0."

        def moved() -> int:
            return sum(m.startswith(last) for role in Role for m in sink.members[role])

        await until_true(lambda: moved() == pods, "the last of the stream", timeout_s=60)
        assert found.publishes - published <= 6  # each pool told at most thrice
        assert sink.pushes - pushes <= 6
    finally:
        await found.stop()
