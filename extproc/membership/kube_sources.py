"""Kubernetes discovery sources: pods by label selector, and an InferencePool's pods.

A pod is a member while it can take requests: phase Running, condition Ready True, not being
deleted (a deletionTimestamp means it is terminating: it gets no new requests, its own ones
finish), and with a pod IP. Pods, not EndpointSlices: an InferencePool selects pods directly
(no Service, so no slices), and the prefill/decode split is a pod label, which slices do not
carry; one code path serves both sources.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extproc.membership.kube_api import INFERENCE_POOLS, PODS, KubeApi, Query
from extproc.membership.kube_watch import Watched

__all__ = ["InferencePoolPods", "PodsBySelector", "ReadyPod", "is_ready"]

log = logging.getLogger("extproc.membership.discovery")


@dataclass(frozen=True)
class ReadyPod:
    ip: str
    labels: dict[str, str]


def is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    terminating = (pod.get("metadata") or {}).get("deletionTimestamp") is not None
    return (
        status.get("phase") == "Running" and ready and not terminating and bool(status.get("podIP"))
    )


def _ready_pods(objects: dict[str, dict[str, Any]]) -> list[ReadyPod]:
    return [
        ReadyPod(pod["status"]["podIP"], dict((pod.get("metadata") or {}).get("labels") or {}))
        for pod in objects.values()
        if is_ready(pod)
    ]


class PodsBySelector:
    """The ready pods that match a label selector in a namespace, watched."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        selector: str,
        on_change: Callable[[], None],
        watch_timeout_s: Callable[[], int],
    ) -> None:
        query = Query(PODS, namespace, label_selector=selector)
        self._watched = Watched(api, query, on_change, watch_timeout_s)

    @property
    def synced(self) -> asyncio.Event:
        return self._watched.synced

    def ready(self) -> list[ReadyPod]:
        return _ready_pods(self._watched.objects)

    def start(self) -> None:
        self._watched.start()

    async def stop(self) -> None:
        await self._watched.stop()


def _selector(spec: dict[str, Any]) -> str:
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


class InferencePoolPods:
    """The ready pods of one InferencePool and its target ports, following the pool.

    The pool is watched too: a new selector starts a new pod watch, which replaces the old
    one only once it has listed (the members never blink empty); a deleted pool has none.
    """

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        on_change: Callable[[], None],
        watch_timeout_s: Callable[[], int],
    ) -> None:
        self.name = f"{namespace}/{name}"
        self.ports: list[int] = []
        self._api, self._namespace = api, namespace
        self._on_change = on_change
        self._watch_timeout_s = watch_timeout_s
        query = Query(INFERENCE_POOLS, namespace, field_selector=f"metadata.name={name}")
        self._pool = Watched(api, query, self._pool_changed, watch_timeout_s)
        self._selector: str | None = None
        self._pods: PodsBySelector | None = None  # the members come from this one
        self._next: PodsBySelector | None = None  # a new selector's watch, until it has listed
        self._retired: set[asyncio.Task[None]] = set()
        self.synced = asyncio.Event()  # the pool listed, and its pods if it exists

    def ready(self) -> list[ReadyPod]:
        return self._pods.ready() if self._pods is not None else []

    def start(self) -> None:
        self._pool.start()

    async def stop(self) -> None:
        await self._pool.stop()
        for pods in (self._pods, self._next):
            if pods is not None:
                await pods.stop()
        await asyncio.gather(*self._retired, return_exceptions=True)

    def _pool_changed(self) -> None:
        spec = next(iter(self._pool.objects.values()), {}).get("spec")
        if spec is None:
            self._follow("", [], "not found")
            return
        ports = [int(p["number"]) for p in spec.get("targetPorts") or [] if p.get("number")]
        self._follow(_selector(spec), ports, "its selector is empty")

    def _follow(self, selector: str, ports: list[int], why_none: str) -> None:
        """Watch the pods of `selector` (none when empty); members use `ports` from now."""
        changed = ports != self.ports
        self.ports = ports
        if selector != self._selector:
            self._selector = selector
            self._retire(self._next)
            self._next = None
            if selector:
                self._next = PodsBySelector(
                    self._api,
                    self._namespace,
                    selector,
                    self._pods_changed,
                    self._watch_timeout_s,
                )
                self._next.start()
            else:
                log.warning("InferencePool %s: %s, no members", self.name, why_none)
                self._retire(self._pods)
                self._pods = None
                changed = True
        if not self._next:
            self.synced.set()
        if changed:
            self._on_change()

    def _pods_changed(self) -> None:
        if self._next is not None and self._next.synced.is_set():
            self._retire(self._pods)
            self._pods, self._next = self._next, None
            self.synced.set()
        self._on_change()

    def _retire(self, pods: PodsBySelector | None) -> None:
        if pods is not None:
            task = asyncio.create_task(pods.stop())
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)
