"""Pool membership: the static list, plus DNS names and Kubernetes pods, kept current.

Each pool's members are the union of its sources. Kubernetes sources (pods by label
selector, an InferencePool's pods of the pool's role) are watched, and kept per pool, pod by
pod: an event costs one pod's work however many pods there are, and a burst of events reaches
the `Members` sink once: when the events pause for `_COALESCE_S`, or every `_COALESCE_MAX_S`
while they never do (each telling costs the whole pool: the sink's update, every EDS stream's
push). DNS names (a headless service) are re-resolved every
`discovery.interval_s`. A source that fails keeps its last members: a DNS hiccup or an API
server restart must not empty a pool. The sink (the wiring's runtime) updates the pool,
forgets identities of endpoints that left, and tells Envoy (EDS).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, cast

from extproc.config import (
    Config,
    InferencePoolSource,
    KubernetesSource,
    PoolConfig,
    parse_host_port,
)
from extproc.periodic import Periodic
from extproc.roles import Role

if TYPE_CHECKING:
    from extproc.membership.kube_api import KubeApi
    from extproc.membership.kube_objects import ReadyPod
    from extproc.membership.kube_sources import InferencePoolPods, PodChanges, PodsBySelector
    from extproc.membership.kube_watch import Complaints

__all__ = ["Discovery", "Members", "resolve_dns"]

log = logging.getLogger("extproc.membership.discovery")

_ROLES = tuple(Role)
_FIRST_SYNC_S = 10.0  # how long the first membership waits for a new watch's first list
_COALESCE_S = 0.05  # watch events this close together reach the sink (and Envoy) once
_COALESCE_MAX_S = 1.0  # ... but a change waits no longer than this in a stream of events

WatchKey = tuple[str, str, str]  # ("pods", namespace, selector) or ("pool", namespace, name)


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


async def resolve_dns(name_port: str) -> list[str]:
    """Every address a name resolves to, as 'ip:port' (sorted, so order is stable)."""
    host, port = parse_host_port(name_port)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({_address(str(info[4][0]), port) for info in infos})


def _watch_key(source: KubernetesSource | InferencePoolSource) -> WatchKey:
    if isinstance(source, KubernetesSource):
        return ("pods", source.namespace, source.label_selector)
    return ("pool", source.namespace, source.name)


class Members(Protocol):
    """Where discovery hands the members it found."""

    def set_group_members(self, model: str, role: Role, members: list[str]) -> None: ...
    def set_members(self, role: Role, members: list[str]) -> None: ...


Kind = str  # which of a pool's Kubernetes sources: "kubernetes" or "inference_pool"
PodTable = dict[str, tuple[str, ...]]  # pod key → the addresses it gives one pool
SourceConfig = KubernetesSource | InferencePoolSource


class Discovery:
    def __init__(
        self,
        members: Members,
        config: Callable[[], Config],  # the current config: a reload swaps it
    ) -> None:
        self._sink = members
        self._config = config
        self._dns: dict[str, list[str]] = {}  # "model/role" → the last good answer
        self._api: KubeApi | None = None
        self._api_settings = ("", "", "")  # what _api was made from
        self._complaints: Complaints | None = None  # about malformed objects, for every watch
        self._watches: dict[WatchKey, PodsBySelector | InferencePoolPods] = {}
        self._periodic: Periodic | None = None
        # Kept per pool, changed per pod: a watch event costs one pod's work, not all pods'.
        self._pods: dict[tuple[str, Role, Kind], PodTable] = {}
        self._published: dict[tuple[str, Role], list[str]] = {}  # what the sink last got
        self._dirty: set[tuple[str, Role]] = set()  # pools changed since the sink was told
        self._flush: asyncio.TimerHandle | None = None
        self._users_of_config: Config | None = None  # the config `_users_by_key` is from
        self._users_by_key: dict[WatchKey, list[tuple[str, Role, Kind, SourceConfig]]] = {}
        self._first_change = 0.0  # loop time of the oldest change the sink has not heard of
        self._last_change = 0.0  # ... and of the newest
        self.evaluations = 0  # pod x pool membership evaluations (a test's count)
        self.publishes = 0  # pool member lists handed to the sink (a test's count)

    def _pools(self) -> Iterator[tuple[str, Role, PoolConfig]]:
        for model, group in self._config().groups().items():
            for role in _ROLES:
                yield model, role, getattr(group, role)

    def _sources(self) -> Iterator[tuple[str, Role, Kind, KubernetesSource | InferencePoolSource]]:
        for model, role, pool in self._pools():
            if pool.kubernetes is not None:
                yield model, role, "kubernetes", pool.kubernetes
            if pool.inference_pool is not None:
                yield model, role, "inference_pool", pool.inference_pool

    async def refresh(self) -> None:
        """Take the sources the config names now (a reload may change them): watch new ones,
        stop those gone, resolve DNS names once, and hand every pool's members to the sink."""
        await self._follow_watches()
        await self._resolve_dns()
        self._pods.clear()
        for model, role, kind, source in self._sources():
            self._pod_changes(model, role, kind, source, None)
        self._published.clear()
        self._publish(None)

    def _source_changed(self, key: WatchKey, changes: PodChanges | None) -> None:
        """A watch's pods changed (`changes`; None: any may have): update the pools that use
        it, and tell the sink soon (a burst of events is told once)."""
        for model, role, kind, source in self._users(key):
            self._pod_changes(model, role, kind, source, changes)
            self._dirty.add((model, role))
        loop = asyncio.get_running_loop()
        self._last_change = now = loop.time()
        if self._flush is None:
            self._first_change = now
            self._flush = loop.call_at(now + _COALESCE_S, self._flush_due)

    def _users(self, key: WatchKey) -> list[tuple[str, Role, Kind, SourceConfig]]:
        """The pools whose source `key` is, found once per config (not once per event)."""
        config = self._config()
        if config is not self._users_of_config:
            self._users_of_config = config
            self._users_by_key = {}
            for model, role, kind, source in self._sources():
                self._users_by_key.setdefault(_watch_key(source), []).append(
                    (model, role, kind, source)
                )
        return self._users_by_key.get(key, [])

    def _pod_changes(
        self,
        model: str,
        role: Role,
        kind: Kind,
        source: KubernetesSource | InferencePoolSource,
        changes: PodChanges | None,
    ) -> None:
        table = self._pods.setdefault((model, role, kind), {})
        watch = self._watches.get(_watch_key(source))
        if changes is None:  # start again from the watch's pods
            table.clear()
            changes = dict(watch.ready()) if watch is not None else {}
        for name, pod in changes.items():
            addresses = self._addresses(role, source, watch, pod) if pod is not None else ()
            if addresses:
                table[name] = addresses
            else:
                table.pop(name, None)

    def _addresses(
        self,
        role: Role,
        source: KubernetesSource | InferencePoolSource,
        watch: PodsBySelector | InferencePoolPods | None,
        pod: ReadyPod,
    ) -> tuple[str, ...]:
        self.evaluations += 1
        if isinstance(source, KubernetesSource):
            return (pod.address(source.port),)
        if not source.takes(role, pod.labels):
            return ()
        # a ("pool", ...) key always holds an InferencePoolPods
        ports = cast("InferencePoolPods", watch).ports
        return tuple(pod.address(port) for port in ports)

    def _flush_due(self) -> None:
        """Tell the sink once the events pause, or once the oldest change has waited long
        enough; else look again then (one timer per burst, not one per event)."""
        loop = asyncio.get_running_loop()
        due = min(self._last_change + _COALESCE_S, self._first_change + _COALESCE_MAX_S)
        if loop.time() < due:
            self._flush = loop.call_at(due, self._flush_due)
            return
        self._flush_dirty()

    def _flush_dirty(self) -> None:
        self._flush = None
        dirty, self._dirty = self._dirty, set()
        self._publish(dirty)

    def _publish(self, pools: set[tuple[str, Role]] | None) -> None:
        """The members of `pools` (None: every pool, told even if unchanged) to the sink, and
        the union of each role whose pools changed."""
        roles: set[Role] = set(_ROLES) if pools is None else set()
        for model, role, pool in self._pools():
            if pools is not None and (model, role) not in pools:
                continue
            members = self._members(model, role, pool)
            if pools is None or members != self._published.get((model, role)):
                self._published[(model, role)] = members
                self._sink.set_group_members(model, role, members)
                self.publishes += 1
                roles.add(role)
        for role in _ROLES:
            if role in roles:
                union = (m for (_, r), ms in self._published.items() if r == role for m in ms)
                self._sink.set_members(role, list(dict.fromkeys(union)))

    def _members(self, model: str, role: Role, pool: PoolConfig) -> list[str]:
        found = list(pool.addresses)
        if pool.dns:
            found += self._dns.get(f"{model}/{role}", [])
        for kind in ("kubernetes", "inference_pool"):
            for addresses in self._pods.get((model, role, kind), {}).values():
                found += addresses
        return list(dict.fromkeys(found))

    async def _resolve_dns(self) -> None:
        for model, role, pool in self._pools():
            if pool.dns:
                where = f"{model}/{role}"
                try:
                    self._dns[where] = await asyncio.wait_for(resolve_dns(pool.dns), timeout=15)
                except (OSError, TimeoutError, ValueError) as error:
                    log.warning(
                        "%s discovery (dns) failed, keeping the last members: %s", where, error
                    )

    async def _follow_watches(self) -> None:
        sources = (s for _, _, p in self._pools() for s in (p.kubernetes, p.inference_pool))
        wanted = {_watch_key(source): source for source in sources if source is not None}
        if self._api is not None and self._api_settings != self._api_settings_now():
            await self._stop_watches()  # another API server or credentials: start again
        for key in set(self._watches) - set(wanted):
            await self._watches.pop(key).stop()
        new = [key for key in wanted if key not in self._watches]
        if not new:
            return
        for key in new:
            self._watches[key] = self._watch(wanted[key])
            self._watches[key].start()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self._watches[key].synced.wait() for key in new)),
                _FIRST_SYNC_S,
            )
        except TimeoutError:
            log.warning(
                "Kubernetes discovery: no answer within %.0f s; going on, the pools "
                "fill as the watches catch up",
                _FIRST_SYNC_S,
            )

    def _watch(
        self, source: KubernetesSource | InferencePoolSource
    ) -> PodsBySelector | InferencePoolPods:
        # Imported here: the Kubernetes client takes half a second to import, which
        # deployments without Kubernetes sources need not pay.
        from extproc.membership.kube_api import KubeApi
        from extproc.membership.kube_sources import InferencePoolPods, PodsBySelector
        from extproc.membership.kube_watch import Complaints

        if self._api is None:
            self._api = KubeApi(self._config().discovery)
            self._complaints = Complaints()
            self._api_settings = self._api_settings_now()
        key = _watch_key(source)

        def changed(changes: PodChanges | None) -> None:
            self._source_changed(key, changes)

        timeout_s, complaints = self._watch_timeout_s, self._complaints
        assert complaints is not None  # made with _api
        if isinstance(source, KubernetesSource):
            return PodsBySelector(
                self._api, source.namespace, source.label_selector, changed, timeout_s, complaints
            )
        return InferencePoolPods(
            self._api, source.namespace, source.name, changed, timeout_s, complaints
        )

    def _api_settings_now(self) -> tuple[str, str, str]:
        settings = self._config().discovery
        return settings.kubernetes_api, settings.token_file, settings.ca_file

    def _watch_timeout_s(self) -> int:
        return self._config().discovery.watch_timeout_s

    def start(self) -> None:
        """Re-resolve DNS names every interval (the first refresh ran before Envoy); the
        watches started with it. The loop runs even with no DNS name (its rounds then do
        nothing): a reload can add one."""
        self._periodic = Periodic(
            "discovery", self._refresh_dns, lambda: self._config().discovery.interval_s
        )
        self._periodic.start(first_now=False)

    async def _refresh_dns(self) -> None:
        named = {(model, role) for model, role, pool in self._pools() if pool.dns}
        if named:
            await self._resolve_dns()
            self._publish(named)

    async def stop(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._periodic is not None:
            await self._periodic.stop()
        await self._stop_watches()

    async def _stop_watches(self) -> None:
        for watch in self._watches.values():
            await watch.stop()
        self._watches.clear()
        if self._api is not None:
            await self._api.close()
            self._api = None
