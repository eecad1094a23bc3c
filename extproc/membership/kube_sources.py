"""Kubernetes discovery sources: pods by label selector, and an InferencePool's pods.

Pods, not EndpointSlices: an InferencePool selects pods directly (no Service, so no slices),
and the prefill/decode split is a pod label, which slices do not carry; one code path serves
both sources. What makes a pod a member, and what makes an object malformed, is in
kube_objects. Both sources report what changed, not everything: `PodChanges` for the pods
that changed, None when every member may have (new target ports, a new selector's pods).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from extproc.membership.kube_api import INFERENCE_POOLS, PODS, KubeApi, Query
from extproc.membership.kube_objects import PoolSpec, ReadyPod, pod_member, pool_spec
from extproc.membership.kube_watch import Changes, Complaints, Watched

__all__ = ["InferencePoolPods", "PodChanges", "PodsBySelector"]

log = logging.getLogger("extproc.membership.discovery")

PodChanges = Changes[ReadyPod]  # pod key → the pod as a member now, None: no longer one


class PodsBySelector:
    """The ready pods that match a label selector in a namespace, watched."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        selector: str,
        on_change: Callable[[PodChanges | None], None],
        watch_timeout_s: Callable[[], int],
        complaints: Complaints,
    ) -> None:
        query = Query(PODS, namespace, label_selector=selector)
        self._watched = Watched(
            api, query, pod_member, on_change, watch_timeout_s, complaints=complaints
        )

    @property
    def synced(self) -> asyncio.Event:
        return self._watched.synced

    def ready(self) -> dict[str, ReadyPod]:
        return self._watched.objects

    def start(self) -> None:
        self._watched.start()

    async def stop(self) -> None:
        await self._watched.stop()


class InferencePoolPods:
    """The ready pods of one InferencePool and its target ports, following the pool.

    The pool is watched too: a new selector starts a new pod watch, which replaces the old
    one only once it has listed (the members never blink empty); a deleted or malformed pool
    has none. Target ports outside 1..65535 are refused, with a warning, the others kept.
    """

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        on_change: Callable[[PodChanges | None], None],
        watch_timeout_s: Callable[[], int],
        complaints: Complaints,
    ) -> None:
        self.name = f"{namespace}/{name}"
        self.ports: tuple[int, ...] = ()
        self._api, self._namespace = api, namespace
        self._on_change = on_change
        self._watch_timeout_s = watch_timeout_s
        self._complaints = complaints
        query = Query(INFERENCE_POOLS, namespace, field_selector=f"metadata.name={name}")
        self._pool = Watched(
            api, query, pool_spec, self._pool_changed, watch_timeout_s, complaints=complaints
        )
        self._selector: str | None = None
        self._refused: tuple[str, ...] = ()
        self._pods: PodsBySelector | None = None  # the members come from this one
        self._next: PodsBySelector | None = None  # a new selector's watch, until it has listed
        self._retired: set[asyncio.Task[None]] = set()
        self.synced = asyncio.Event()  # the pool listed, and its pods if it exists

    def ready(self) -> dict[str, ReadyPod]:
        return self._pods.ready() if self._pods is not None else {}

    def start(self) -> None:
        self._pool.start()

    async def stop(self) -> None:
        await self._pool.stop()
        for pods in (self._pods, self._next):
            if pods is not None:
                await pods.stop()
        await asyncio.gather(*self._retired, return_exceptions=True)

    def _pool_changed(self, _: Changes[PoolSpec]) -> None:
        spec = next(iter(self._pool.objects.values()), None)
        if spec is None:  # a malformed pool had its warning
            self._follow("", (), None if self._pool.malformed else "not found")
            return
        if spec.refused and spec.refused != self._refused:
            log.warning(
                "InferencePool %s: targetPorts %s refused (a port is 1-65535)%s",
                self.name,
                ", ".join(spec.refused),
                "" if spec.ports else "; no port left, no members",
            )
        self._refused = spec.refused
        self._follow(spec.selector, spec.ports, "its selector is empty")

    def _follow(self, selector: str, ports: tuple[int, ...], why_none: str | None) -> None:
        """Watch the pods of `selector` (none when empty); members use `ports` from now."""
        changed = ports != self.ports
        self.ports = ports
        if selector != self._selector:
            self._selector = selector
            self._retire(self._next)
            self._next = None
            if selector:
                self._next = self._watch_pods(selector)
                self._next.start()
            else:
                if why_none is not None:
                    log.warning("InferencePool %s: %s, no members", self.name, why_none)
                self._retire(self._pods)
                self._pods = None
                changed = True
        if not self._next:
            self.synced.set()
        if changed:
            self._on_change(None)

    def _watch_pods(self, selector: str) -> PodsBySelector:
        def changed(changes: PodChanges | None) -> None:
            self._pods_changed(pods, changes)

        pods = PodsBySelector(
            self._api, self._namespace, selector, changed, self._watch_timeout_s, self._complaints
        )
        return pods

    def _pods_changed(self, pods: PodsBySelector, changes: PodChanges | None) -> None:
        if pods is self._next:  # it has listed: it takes over, every member may differ
            self._retire(self._pods)
            self._pods, self._next = self._next, None
            self.synced.set()
            self._on_change(None)
        elif pods is self._pods:
            self._on_change(changes)

    def _retire(self, pods: PodsBySelector | None) -> None:
        if pods is not None:
            task = asyncio.create_task(pods.stop())
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)
