"""Pool membership: the static list, plus DNS names and Kubernetes pods, kept current.

Each pool's members are the union of its sources. Kubernetes sources (pods by label
selector, an InferencePool's pods of the pool's role) are watched: every change reaches the
`Members` sink at once. DNS names (a headless service) are re-resolved every
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
    from extproc.membership.kube_sources import InferencePoolPods, PodsBySelector

__all__ = ["Discovery", "Members", "resolve_dns"]

log = logging.getLogger("extproc.membership.discovery")

_ROLES = tuple(Role)
_FIRST_SYNC_S = 10.0  # how long the first membership waits for a new watch's first list

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
        self._watches: dict[WatchKey, PodsBySelector | InferencePoolPods] = {}
        self._periodic: Periodic | None = None

    def _pools(self) -> Iterator[tuple[str, Role, PoolConfig]]:
        for model, group in self._config().groups().items():
            for role in _ROLES:
                yield model, role, getattr(group, role)

    async def refresh(self) -> None:
        """Take the sources the config names now (a reload may change them): watch new ones,
        stop those gone, resolve DNS names once, and hand every pool's members to the sink."""
        await self._follow_watches()
        await self._resolve_dns()
        self._publish()

    def _publish(self) -> None:
        """Every pool's members, from what each source knows now, to the sink."""
        union: dict[Role, list[str]] = {role: [] for role in _ROLES}
        for model, role, pool in self._pools():
            members = list(dict.fromkeys(self._members(f"{model}/{role}", role, pool)))
            self._sink.set_group_members(model, role, members)
            union[role] += members
        for role in _ROLES:
            self._sink.set_members(role, list(dict.fromkeys(union[role])))

    def _members(self, where: str, role: Role, pool: PoolConfig) -> Iterator[str]:
        yield from pool.addresses
        if pool.dns:
            yield from self._dns.get(where, [])
        if pool.kubernetes is not None:
            pods = self._watches.get(_watch_key(pool.kubernetes))
            for pod in pods.ready() if pods is not None else []:
                yield _address(pod.ip, pool.kubernetes.port)
        if pool.inference_pool is not None:
            yield from self._inference_pool_members(role, pool.inference_pool)

    def _inference_pool_members(self, role: Role, source: InferencePoolSource) -> Iterator[str]:
        # a ("pool", ...) key always holds an InferencePoolPods
        watch = cast("InferencePoolPods | None", self._watches.get(_watch_key(source)))
        if watch is None:
            return
        for pod in watch.ready():
            if source.takes(role, pod.labels):
                yield from (_address(pod.ip, port) for port in watch.ports)

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

        if self._api is None:
            self._api = KubeApi(self._config().discovery)
            self._api_settings = self._api_settings_now()
        if isinstance(source, KubernetesSource):
            return PodsBySelector(
                self._api,
                source.namespace,
                source.label_selector,
                self._publish,
                self._watch_timeout_s,
            )
        return InferencePoolPods(
            self._api, source.namespace, source.name, self._publish, self._watch_timeout_s
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
        if any(pool.dns for _, _, pool in self._pools()):
            await self._resolve_dns()
            self._publish()

    async def stop(self) -> None:
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
