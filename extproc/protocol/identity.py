"""What the sidecar knows of each prefill engine's NIXL identity.

vLLM has no endpoint that advertises a P's identity; it is learned from the
`kv_transfer_params` of P's own prefill responses. The cache is keyed by prefill endpoint and,
for an engine with data-parallel ranks behind one port, by rank (each rank is its own NIXL
engine, `<engine_id>_dp<rank>`); it is refreshed from every P response. An identity is dropped on
a P error, a P timeout, a D error or a mismatch, so the next request learns it again. An
endpoint (or rank) whose identity keeps changing is served serially for a cool-down.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IdentityCache", "PrefillIdentity", "identity_from_params", "ranks_of", "where"]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class PrefillIdentity:
    """The fields a decode engine's NIXL connector needs to register a push with this P."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int
    dcp_size: int
    transfer_mode: str | None  # "push" | "pull"; None before vLLM 0.28

    def decode_params(self, request_id: str, transfer_id: str) -> dict[str, Any]:
        """D's kv_transfer_params for a parallel push dispatch."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "dcp_size": self.dcp_size,
            # Only P's lease heartbeat reads it; any string works in push mode.
            "remote_request_id": request_id,
            "transfer_id": transfer_id,
        }


def _positive_int(params: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = params.get(key, default)
    if value is None and default is not None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{key} must be a positive integer (got {value!r})")
    return value


@functools.lru_cache(maxsize=1024)  # a P answers with the same host every time: parse it once
def _checked_host(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        labels = value.split(".")
        if not all(label and label.replace("-", "").isalnum() for label in labels):
            raise ValueError(f"remote_host is not a valid host name (got {value!r})") from None
    return value


def _valid_host(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 253:
        raise ValueError(f"remote_host must be a host name or IP (got {value!r})")
    return _checked_host(value)


def identity_from_params(params: Any) -> PrefillIdentity:
    """Validate P's kv_transfer_params before anything is forwarded; ValueError if unusable."""
    if not isinstance(params, Mapping):
        raise ValueError("P returned no kv_transfer_params (is it started with a KV connector?)")
    engine_id = params.get("remote_engine_id")
    if not isinstance(engine_id, str) or not engine_id or len(engine_id) > 256:
        raise ValueError(f"remote_engine_id must be a non-empty string (got {engine_id!r})")
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"remote_port must be 1-65535 (got {port!r})")
    mode = params.get("transfer_mode")
    if mode not in (None, "push", "pull"):
        raise ValueError(f"transfer_mode must be 'push' or 'pull' (got {mode!r})")
    return PrefillIdentity(
        engine_id=engine_id,
        host=_valid_host(params.get("remote_host")),
        port=port,
        tp_size=_positive_int(params, "tp_size"),
        pp_size=_positive_int(params, "pp_size", 1),
        dcp_size=_positive_int(params, "dcp_size", 1),
        transfer_mode=mode,
    )


def ranks_of(data_parallel_size: int) -> list[int | None]:
    """The ranks to key an endpoint's identities by: None for an engine without data
    parallelism (no rank header is sent), else 0 .. N-1."""
    return [None] if data_parallel_size <= 1 else list(range(data_parallel_size))


def where(endpoint: str, rank: int | None) -> str:
    """How logs, metrics and /ready name one identity: the endpoint, with its rank if any."""
    return endpoint if rank is None else f"{endpoint} dp{rank}"


def of_where(label: str) -> tuple[str, int | None]:
    """The endpoint and rank `where` named."""
    endpoint, _, rank = label.partition(" dp")
    return endpoint, int(rank) if rank.isdigit() else None


@dataclass
class _Entry:
    identity: PrefillIdentity | None = None
    last: PrefillIdentity | None = None  # survives drops, so a restart still counts as a change
    changes: deque[float] = field(default_factory=deque)
    serial_until: float = 0.0


class IdentityCache:
    """Per-endpoint (and per-rank) identities; every transition is reported to
    `on_event(where, event)` (`where`: the endpoint, or "endpoint dpN" for rank N).

    Events: learned (after a miss), refreshed (same again), changed (a different engine than the
    last one seen, even across a drop), dropped, flapping.
    """

    def __init__(
        self,
        flap_threshold: int,
        flap_window_s: float,
        serial_cooldown_s: float,
        on_event: Callable[[str, str], None] = lambda endpoint, event: None,
        clock: Clock = time.monotonic,
    ) -> None:
        self._entries: dict[str, dict[int | None, _Entry]] = {}  # endpoint → rank → entry
        self._flap_threshold = flap_threshold
        self._flap_window_s = flap_window_s
        self._serial_cooldown_s = serial_cooldown_s
        self._on_event = on_event
        self._clock = clock

    def set_flap_limits(
        self, flap_threshold: int, flap_window_s: float, serial_cooldown_s: float
    ) -> None:
        """A reload's new flap settings; cool-downs already running keep their end time."""
        self._flap_threshold = flap_threshold
        self._flap_window_s = flap_window_s
        self._serial_cooldown_s = serial_cooldown_s

    def _entry(self, endpoint: str, rank: int | None) -> _Entry | None:
        return self._entries.get(endpoint, {}).get(rank)

    def get(self, endpoint: str, rank: int | None = None) -> PrefillIdentity | None:
        entry = self._entry(endpoint, rank)
        return None if entry is None else entry.identity

    def missing(self, endpoint: str, data_parallel_size: int = 1) -> list[int | None]:
        """The ranks of `endpoint` whose identity is not known (None: the endpoint's own)."""
        return [r for r in ranks_of(data_parallel_size) if self.get(endpoint, r) is None]

    def serial_only(self, endpoint: str, rank: int | None = None) -> bool:
        entry = self._entry(endpoint, rank)
        return entry is not None and self._clock() < entry.serial_until

    def learn(self, endpoint: str, identity: PrefillIdentity, rank: int | None = None) -> None:
        """Record what P just reported; a different engine than before counts as a change."""
        entry = self._entries.setdefault(endpoint, {}).setdefault(rank, _Entry())
        known, previous = entry.identity, entry.last
        entry.identity = entry.last = identity
        label = where(endpoint, rank)
        if known == identity:
            self._on_event(label, "refreshed")
        elif previous is None or previous == identity:
            self._on_event(label, "learned")
        else:
            self._on_event(label, "changed")
            self._count_change(label, entry)

    def _count_change(self, label: str, entry: _Entry) -> None:
        now = self._clock()
        entry.changes.append(now)
        while entry.changes and now - entry.changes[0] > self._flap_window_s:
            entry.changes.popleft()
        if len(entry.changes) >= self._flap_threshold:
            entry.serial_until = now + self._serial_cooldown_s
            entry.changes.clear()
            self._on_event(label, "flapping")

    def drop(
        self, endpoint: str, only_if: PrefillIdentity | None = None, rank: int | None = None
    ) -> bool:
        """Forget an identity (only if it is still `only_if`, when given): `rank`'s, or without
        a rank every identity of the endpoint (a health failure or a restart is the server's)."""
        entries = self._entries.get(endpoint, {})
        dropped = False
        for key, entry in list(entries.items()):
            if rank is not None and key != rank:
                continue
            if entry.identity is None or (only_if is not None and entry.identity != only_if):
                continue
            entry.identity = None
            self._on_event(where(endpoint, key), "dropped")
            dropped = True
        return dropped

    def forget(self, endpoint: str) -> None:
        """The endpoint left the pool."""
        self._entries.pop(endpoint, None)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """For /ready and tests: what is known of each endpoint (each rank apart)."""
        now = self._clock()
        return {
            where(endpoint, rank): {
                "engine_id": None if e.identity is None else e.identity.engine_id,
                "transfer_mode": None if e.identity is None else e.identity.transfer_mode,
                "serial_only": now < e.serial_until,
            }
            for endpoint, ranks in self._entries.items()
            for rank, e in ranks.items()
        }
