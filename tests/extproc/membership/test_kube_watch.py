"""Kubernetes discovery against the fake API server: list + watch, resume, 410, backoff, and
what makes a pod a member (readiness, termination, InferencePool roles, ports, selector)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest
import pytest_asyncio

from extproc.config import DiscoveryConfig, parse_config
from extproc.membership.discovery import Discovery
from extproc.membership.kube_api import PODS, KubeApi, Listing, Query
from extproc.membership.kube_objects import ReadyPod, pod_member
from extproc.membership.kube_watch import Watched
from extproc.roles import Role
from tests.support.kube_api import FakeKubeApi, fake_kube_api, inference_pool, pod


async def until(check: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Poll `check` until it holds; fail after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest_asyncio.fixture
async def kube(tmp_path: Path) -> AsyncIterator[tuple[FakeKubeApi, DiscoveryConfig]]:
    token = tmp_path / "token"
    token.write_text("token-1\n")
    async with fake_kube_api() as fake:
        yield (
            fake,
            DiscoveryConfig(kubernetes_api=fake.url, token_file=str(token), ca_file="/nonexistent"),
        )


@pytest_asyncio.fixture
async def watched(
    kube: tuple[FakeKubeApi, DiscoveryConfig],
) -> AsyncIterator[tuple[FakeKubeApi, Watched[ReadyPod], list[int]]]:
    fake, settings = kube
    api = KubeApi(settings)
    changes: list[int] = []
    watch = Watched(
        api,
        Query(PODS, "default", label_selector="app=vllm"),
        pod_member,
        lambda _: changes.append(1),
        lambda: 30,
        backoff_s=(0.05, 0.2),
    )
    fake.put_pod(pod("a", "10.0.0.1", {"app": "vllm"}))
    fake.put_pod(pod("other", "10.0.0.9", {"app": "other"}))
    watch.start()
    await asyncio.wait_for(watch.synced.wait(), 5)
    try:
        yield fake, watch, changes
    finally:
        await watch.stop()
        await api.close()


def names(watch: Watched[ReadyPod]) -> set[str]:
    return {key.split("/")[1] for key in watch.objects}


async def test_watch_follows_changes_from_the_lists_version(
    watched: tuple[FakeKubeApi, Watched[ReadyPod], list[int]],
) -> None:
    fake, watch, changes = watched
    assert names(watch) == {"a"}  # the selector narrows the list
    listed_at = fake.lists("pods")[0]
    await until(lambda: len(fake.watches("pods")) == 1, "the watch")
    assert fake.watches("pods")[0]["resourceVersion"] == watch.resource_version
    assert fake.watches("pods")[0]["timeoutSeconds"] == "30"  # bounded by the server
    assert fake.watches("pods")[0]["allowWatchBookmarks"].lower() == "true"
    assert listed_at["auth"] == "Bearer token-1"
    fake.put_pod(pod("b", "10.0.0.2", {"app": "vllm"}))
    await until(lambda: names(watch) == {"a", "b"}, "ADDED")
    fake.put_pod(pod("b", "10.0.0.2", {"app": "vllm"}, ready=False))
    await until(lambda: names(watch) == {"a"}, "MODIFIED: not ready, not a member")
    fake.put_pod(pod("b", "10.0.0.2", {"app": "vllm"}))
    await until(lambda: names(watch) == {"a", "b"}, "MODIFIED: ready again")
    fake.delete_pod("a")
    await until(lambda: names(watch) == {"b"}, "DELETED")
    assert len(changes) == 5  # the list, then one call per event that changed a member
    assert len(fake.lists("pods")) == 1


async def test_reconnect_resumes_from_the_last_event_or_bookmark(
    watched: tuple[FakeKubeApi, Watched[ReadyPod], list[int]],
) -> None:
    fake, watch, changes = watched
    await until(lambda: len(fake.watches("pods")) == 1, "the watch")
    fake.put_pod(pod("b", "10.0.0.2", {"app": "vllm"}))
    await until(lambda: "default/b" in watch.objects, "ADDED")
    fake.bookmark()
    await until(lambda: watch.resource_version == str(fake.version), "the bookmark's version")
    seen = len(changes)
    fake.close_watches()  # the connection ends: resume, do not list again
    await until(lambda: len(fake.watches("pods")) == 2, "the second watch")
    assert fake.watches("pods")[1]["resourceVersion"] == str(fake.version)
    assert len(fake.lists("pods")) == 1
    assert len(changes) == seen  # a bookmark and a reconnect change nothing


@pytest.mark.parametrize("as_status", [False, True], ids=["error-event", "http-status"])
async def test_gone_lists_again(
    watched: tuple[FakeKubeApi, Watched[ReadyPod], list[int]], as_status: bool
) -> None:
    fake, watch, _ = watched
    fake.gone_as_status = as_status
    await until(lambda: len(fake.watches("pods")) == 1, "the watch")
    fake.close_watches()
    # while nobody watches: a change, then the history is compacted away
    fake.delete_pod("a")
    fake.put_pod(pod("c", "10.0.0.3", {"app": "vllm"}))
    fake.compact()
    await until(lambda: len(fake.lists("pods")) == 2, "a second list after 410")
    await until(lambda: names(watch) == {"c"}, "the objects replaced by the new list")
    await until(lambda: len(fake.watches("pods")) == 3, "a watch from the new list")
    assert fake.watches("pods")[2]["resourceVersion"] == str(fake.version)  # the new list's


async def test_failures_keep_the_objects_back_off_and_log_once(
    watched: tuple[FakeKubeApi, Watched[ReadyPod], list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    fake, watch, _ = watched
    await until(lambda: len(fake.watches("pods")) == 1, "the watch")
    caplog.set_level(logging.INFO, "extproc.membership.discovery")
    fake.fail(3)
    fake.close_watches()
    await until(lambda: len(fake.watches("pods")) == 5, "three failed tries and a good one")
    assert names(watch) == {"a"}  # kept through the failures
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "watch failed, keeping the last members" in warnings[0].getMessage()
    fake.put_pod(pod("d", "10.0.0.4", {"app": "vllm"}))
    await until(lambda: "default/d" in watch.objects, "events again after the failures")
    assert any("watching again" in r.getMessage() for r in caplog.records)
    assert len(fake.lists("pods")) == 1  # resumed from its version, no re-list


@pytest.mark.parametrize(
    ("changes", "member"),
    [
        ({}, True),
        ({"ready": False}, False),
        ({"terminating": True}, False),
        ({"phase": "Pending"}, False),
        ({"ip": ""}, False),
    ],
)
def test_which_pods_are_members(changes: dict[str, Any], member: bool) -> None:
    ip = changes.pop("ip", "10.0.0.1")
    assert (pod_member(pod("p", ip, **changes)) is not None) is member


class Sink:
    def __init__(self) -> None:
        self.members: dict[Role, list[str]] = {Role.PREFILL: [], Role.DECODE: []}
        self.calls = 0

    def set_group_members(self, model: str, role: Role, members: list[str]) -> None:
        pass

    def set_members(self, role: Role, members: list[str]) -> None:
        self.members[role] = sorted(members)
        self.calls += 1


@pytest_asyncio.fixture
async def pool_discovery(
    kube: tuple[FakeKubeApi, DiscoveryConfig],
) -> AsyncIterator[tuple[FakeKubeApi, Sink]]:
    fake, settings = kube
    source = {"inference_pool": {"name": "llama"}}
    config = parse_config({"prefill": source, "decode": source, "discovery": settings.model_dump()})
    sink = Sink()
    discovery = Discovery(sink, lambda: config)
    fake.put_pod(pod("p-0", "10.0.0.1", {"app": "vllm", "llm-d.ai/role": "prefill"}))
    fake.put_pod(pod("d-0", "10.0.0.2", {"app": "vllm", "llm-d.ai/role": "decode"}))
    await discovery.refresh()  # no pool yet: no members, and no hang
    try:
        yield fake, sink
    finally:
        await discovery.stop()


async def test_inference_pool_members_by_role(pool_discovery: tuple[FakeKubeApi, Sink]) -> None:
    fake, sink = pool_discovery
    assert sink.members == {Role.PREFILL: [], Role.DECODE: []}
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 8000))
    await until(lambda: sink.members[Role.PREFILL] == ["10.0.0.1:8000"], "the prefill pod")
    assert sink.members[Role.DECODE] == ["10.0.0.2:8000"]
    fake.put_pod(pod("both-0", "10.0.0.3", {"app": "vllm", "llm-d.ai/role": "both"}))
    fake.put_pod(pod("plain-0", "10.0.0.4", {"app": "vllm"}))  # no role label: decode
    fake.put_pod(pod("odd-0", "10.0.0.5", {"app": "vllm", "llm-d.ai/role": "encode"}))
    fake.put_pod(pod("elsewhere", "10.0.0.6", {"app": "other", "llm-d.ai/role": "decode"}))
    await until(lambda: len(sink.members[Role.DECODE]) == 3, "both and unlabelled pods")
    assert sink.members[Role.DECODE] == ["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"]
    assert sink.members[Role.PREFILL] == ["10.0.0.1:8000"]  # "encode" is in neither


async def test_inference_pool_changes_are_followed(
    pool_discovery: tuple[FakeKubeApi, Sink],
) -> None:
    fake, sink = pool_discovery
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 8000))
    await until(lambda: sink.members[Role.DECODE] == ["10.0.0.2:8000"], "the pool's pods")
    fake.put_pool(inference_pool("llama", {"app": "vllm"}, 9000))  # a new target port
    await until(lambda: sink.members[Role.DECODE] == ["10.0.0.2:9000"], "the new port")
    fake.put_pod(pod("d-1", "10.0.0.7", {"app": "vllm-v2", "llm-d.ai/role": "decode"}))
    fake.put_pool(inference_pool("llama", {"app": "vllm-v2"}, 9000))  # a new selector
    await until(lambda: sink.members[Role.DECODE] == ["10.0.0.7:9000"], "the new selector")
    assert sink.members[Role.PREFILL] == []
    fake.delete_pool("llama")
    await until(lambda: sink.members[Role.DECODE] == [], "no pool, no members")


async def test_a_rotated_token_is_used_from_the_next_request(
    watched: tuple[FakeKubeApi, Watched[ReadyPod], list[int]], tmp_path: Path
) -> None:
    fake, _, _ = watched
    await until(lambda: len(fake.watches("pods")) == 1, "the watch")
    (tmp_path / "token").write_text("token-2\n")
    fake.close_watches()
    await until(lambda: len(fake.watches("pods")) == 2, "the reconnect")
    assert [w["auth"] for w in fake.watches("pods")] == ["Bearer token-1", "Bearer token-2"]


async def test_a_reload_follows_the_sources_the_config_names_now(
    kube: tuple[FakeKubeApi, DiscoveryConfig],
) -> None:
    fake, settings = kube
    fake.put_pod(pod("a", "10.0.0.1", {"role": "decode-a"}))
    fake.put_pod(pod("b", "10.0.0.2", {"role": "decode-b"}))

    def config_with(selector: str) -> Any:
        decode = {"kubernetes": {"label_selector": selector, "port": 8000}}
        return parse_config(
            {
                "prefill": {"endpoints": ["10.0.9.9:8000"]},
                "decode": decode,
                "discovery": settings.model_dump(),
            }
        )

    config = config_with("role=decode-a")
    sink = Sink()
    discovery = Discovery(sink, lambda: config)
    try:
        await discovery.refresh()  # the first membership waits for the first list
        assert sink.members[Role.DECODE] == ["10.0.0.1:8000"]
        assert sink.members[Role.PREFILL] == ["10.0.9.9:8000"]
        config = config_with("role=decode-b")
        await discovery.refresh()
        assert sink.members[Role.DECODE] == ["10.0.0.2:8000"]
        fake.put_pod(pod("a2", "10.0.0.3", {"role": "decode-a"}))  # the old selector's
        fake.put_pod(pod("b2", "10.0.0.4", {"role": "decode-b"}))
        await until(lambda: len(sink.members[Role.DECODE]) == 2, "the new selector's pod")
        assert sink.members[Role.DECODE] == ["10.0.0.2:8000", "10.0.0.4:8000"]
    finally:
        await discovery.stop()


async def test_gone_even_from_a_fresh_list_backs_off_instead_of_spinning(
    watched: tuple[FakeKubeApi, Watched[ReadyPod], list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    fake, watch, _ = watched
    await until(lambda: len(fake.watches("pods")) == 1, "the watch")
    caplog.set_level(logging.INFO, "extproc.membership.discovery")
    fake.oldest = fake.version + 1_000  # a broken server: every version is too old
    fake.close_watches()
    await until(lambda: len(fake.lists("pods")) >= 4, "lists again and again")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("watch failed" in m for m in messages) == 1, messages  # one line, then pauses
    assert sum("listing again" in m for m in messages) == 1, messages  # only the first 410
    assert names(watch) == {"a"}


async def test_stop_ends_a_watch_whose_list_lost_the_cancellation(
    kube: tuple[FakeKubeApi, DiscoveryConfig],
) -> None:
    """Python 3.11's wait_for returns a result that arrived in the same loop turn as a cancel,
    and the cancel is lost; the watch then carries on. Stop must still end it."""
    fake, settings = kube
    api = KubeApi(settings)
    real_list = api.list
    cancelled_in_list = asyncio.Event()

    async def list_losing_its_cancel(query: Query) -> Any:
        listing = await real_list(query)
        try:
            await asyncio.sleep(3600)  # stop() finds the watch here
        except asyncio.CancelledError:
            cancelled_in_list.set()  # and the cancel goes no further
        return listing

    api.list = list_losing_its_cancel  # type: ignore[method-assign]
    watch = Watched(api, Query(PODS, "default"), pod_member, lambda _: None, lambda: 30)
    watch.start()
    await until(lambda: len(fake.lists("pods")) == 1, "the list")
    try:
        await asyncio.wait_for(watch.stop(), 5)
        assert cancelled_in_list.is_set()
        assert watch.synced.is_set()  # the list returned as if never cancelled: the loop went on
    finally:
        await api.close()


class BufferedBurst:
    """A KubeApi stand-in whose one watch hands out `count` events without ever waiting, as
    `async for line in response.content` does for a burst already in the connection's buffer;
    the next watch stays open and quiet."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.watches = 0

    async def list(self, query: Query) -> Listing:
        return Listing([], "1")

    async def watch(
        self, query: Query, resource_version: str, timeout_s: int
    ) -> AsyncIterator[dict[str, Any]]:
        self.watches += 1
        if self.watches > 1:
            await asyncio.Event().wait()
        for i in range(self.count):
            labels = {"app": "vllm"}
            yield {"type": "ADDED", "object": pod(f"p-{i}", f"10.0.{i // 250}.{i % 250}", labels)}


async def test_a_burst_of_events_is_applied_in_slices_that_let_the_loop_run() -> None:
    events = 2000
    watch = Watched(
        cast(KubeApi, BufferedBurst(events)),
        Query(PODS, "default", label_selector="app=vllm"),
        pod_member,
        lambda _: None,
        lambda: 30,
    )
    turns = 0
    burst_done = asyncio.Event()

    async def beside() -> None:  # another task: how often it runs while the burst is applied
        nonlocal turns
        while not burst_done.is_set():
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(beside())  # before the burst: every slice of it is counted
    try:
        watch.start()
        await asyncio.wait_for(watch.synced.wait(), 5)
        await until(lambda: len(watch.objects) == events, "the burst")
    finally:
        burst_done.set()
        await other
        await watch.stop()
    assert turns >= events // 64 - 1  # a turn at least every slice, not once for the burst
