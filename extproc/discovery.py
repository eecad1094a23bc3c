"""Pool membership: the static list, plus DNS names and Kubernetes pods, kept current.

Each pool's members are the union of its sources. DNS names (a headless service) and
Kubernetes label selectors are re-read every `discovery.interval_s`. A source that fails to
answer keeps its last members: a DNS hiccup must not empty a pool. Changes go to a `Members`
sink (the wiring's runtime), which updates the pool, forgets identities of endpoints that
left, and tells Envoy (EDS).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from extproc.config import Config, KubernetesSource, PoolConfig, parse_host_port
from extproc.periodic import Periodic
from extproc.roles import Role

__all__ = ["Discovery", "kubernetes_members", "resolve_dns"]

log = logging.getLogger("extproc.discovery")

_ROLES = tuple(Role)


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


async def resolve_dns(name_port: str) -> list[str]:
    """Every address a name resolves to, as 'ip:port' (sorted, so order is stable)."""
    host, port = parse_host_port(name_port)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({_address(str(info[4][0]), port) for info in infos})


def _ready_pod_ips(pods: dict[str, Any]) -> list[str]:
    ips = []
    for pod in pods.get("items", []):
        status = pod.get("status", {})
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions", [])
        )
        if status.get("phase") == "Running" and ready and status.get("podIP"):
            ips.append(status["podIP"])
    return ips


async def kubernetes_members(
    session: aiohttp.ClientSession, api: str, source: KubernetesSource,
    token: str | None, tls: ssl.SSLContext | None,
) -> list[str]:  # fmt: skip
    """Ready pods matching the selector, as 'podIP:port'."""
    url = (
        f"{api}/api/v1/namespaces/{quote(source.namespace)}/pods"
        f"?labelSelector={quote(source.label_selector)}"
    )
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with session.get(
        url, headers=headers, ssl=tls if tls is not None else True,
        timeout=aiohttp.ClientTimeout(total=10),
    ) as response:  # fmt: skip
        response.raise_for_status()
        pods = await response.json()
    return sorted(_address(ip, source.port) for ip in _ready_pod_ips(pods))


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
        self._last: dict[tuple[str, str], list[str]] = {}  # (role, source) → last good answer
        self._periodic: Periodic | None = None

    @property
    def dynamic(self) -> bool:
        cfg = self._config()
        return any(
            pool.dns or pool.kubernetes for role in _ROLES for pool in cfg.pool_configs(role)
        )

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        """Resolve every source of every pool once and hand the result to the runtime."""
        for role in _ROLES:
            union: list[str] = []
            for model, group in self._config().groups().items():
                members = await self._members(session, f"{model}/{role}", getattr(group, role))
                self._sink.set_group_members(model, role, members)
                union += members
            self._sink.set_members(role, list(dict.fromkeys(union)))

    async def _members(
        self, session: aiohttp.ClientSession, role: str, pool: PoolConfig
    ) -> list[str]:
        members = list(pool.addresses)
        if pool.dns:
            members += await self._source(role, "dns", resolve_dns(pool.dns))
        if pool.kubernetes:
            members += await self._source(role, "kubernetes", self._kubernetes(session, pool))
        return list(dict.fromkeys(members))

    async def _source(self, role: str, name: str, lookup: Awaitable[list[str]]) -> list[str]:
        try:
            found = await asyncio.wait_for(lookup, timeout=15)
        except (OSError, aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.warning("%s discovery (%s) failed, keeping the last members: %s", role, name, error)
            return self._last.get((role, name), [])
        self._last[(role, name)] = found
        return found

    async def _kubernetes(self, session: aiohttp.ClientSession, pool: PoolConfig) -> list[str]:
        assert pool.kubernetes is not None
        cfg = self._config().discovery
        token_path, ca_path = Path(cfg.token_file), Path(cfg.ca_file)
        token = await asyncio.to_thread(_read_if_exists, token_path)
        tls = None
        if cfg.kubernetes_api.startswith("https") and await asyncio.to_thread(ca_path.exists):
            tls = await asyncio.to_thread(ssl.create_default_context, cafile=str(ca_path))
        return await kubernetes_members(session, cfg.kubernetes_api, pool.kubernetes, token, tls)

    def start(self, session: aiohttp.ClientSession) -> None:
        """Re-read the dynamic sources every interval (the first refresh ran before Envoy).

        The loop runs even with static pools only (its rounds then do nothing): a reload can
        add or remove DNS names and selectors.
        """
        self._periodic = Periodic(
            "discovery", lambda: self._refresh_dynamic(session),
            lambda: self._config().discovery.interval_s,
        )  # fmt: skip
        self._periodic.start(first_now=False)

    async def _refresh_dynamic(self, session: aiohttp.ClientSession) -> None:
        if self.dynamic:
            await self.refresh(session)

    async def stop(self) -> None:
        if self._periodic is not None:
            await self._periodic.stop()


def _read_if_exists(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None
