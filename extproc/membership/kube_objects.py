"""What discovery reads from a Pod and an InferencePool, checked field by field.

The API server validates what it stores, but a proxy, an old CRD schema or a hostile server
may hand over anything: every field discovery reads is checked here, once per object version,
and an object that does not hold is refused whole (`Malformed`, with what is wrong); only an
InferencePool's target ports are refused one by one (outside 1..65535: no Envoy endpoint).
The watch skips a malformed object; no other object, pool or the start can be hurt by it.

A pod is a member while it can take requests: phase Running, condition Ready True, not being
deleted (a deletionTimestamp means it is terminating: it gets no new requests, its own ones
finish), and with a pod IP. A pod that is not (yet) one is not malformed: a pending pod has
no IP and no conditions.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

__all__ = ["Malformed", "PoolSpec", "ReadyPod", "pod_member", "pool_spec"]

_MAX_PORT = 65535


class Malformed(ValueError):
    """The object is not what the API defines; the message says which field and why."""


@dataclass(frozen=True)
class ReadyPod:
    host: str  # the pod IP as an address's host: "10.0.0.1", "[fd00::1]"
    labels: dict[str, str]

    def address(self, port: int) -> str:
        return f"{self.host}:{port}"


@dataclass(frozen=True)
class PoolSpec:
    selector: str  # "k=v,k2=v2" from matchLabels; "" when it has none
    ports: tuple[int, ...]  # the valid target ports
    refused: tuple[str, ...]  # the target ports refused (out of 1..65535, not integers)


def _field(obj: dict[str, Any], name: str, kind: type, where: str) -> Any:
    """obj[name] when it is a `kind` or absent (then None); Malformed otherwise."""
    value = obj.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise Malformed(f"{where}{name} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _mapping(obj: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    value: dict[str, Any] = _field(obj, name, dict, where) or {}
    return value


def _labels(obj: dict[str, Any], name: str, where: str) -> dict[str, str]:
    labels = _mapping(obj, name, where)
    for key, value in labels.items():
        if not isinstance(value, str):
            raise Malformed(f"{where}{name}.{key} is a {type(value).__name__}, not a str")
    return labels


def _host(ip: str) -> str:
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        raise Malformed(f"status.podIP {ip[:64]!r} is not an IP address") from None
    if address.version == 4:
        return str(address)
    if address.scope_id:
        raise Malformed(f"status.podIP {ip[:64]!r} has a zone: not a pod IP")
    return f"[{address}]"


def _ready(status: dict[str, Any]) -> bool:
    conditions = _field(status, "conditions", list, "status.") or []
    ready = False
    for index, condition in enumerate(conditions):
        if not isinstance(condition, dict):
            raise Malformed(f"status.conditions[{index}] is a {type(condition).__name__}")
        where = f"status.conditions[{index}]."
        is_ready = _field(condition, "type", str, where) == "Ready"
        ready |= is_ready and _field(condition, "status", str, where) == "True"
    return ready


def pod_member(pod: dict[str, Any]) -> ReadyPod | None:
    """The pod as a member (its IP and labels), None while it cannot take requests."""
    metadata = _mapping(pod, "metadata", "")
    labels = _labels(metadata, "labels", "metadata.")
    if "status" not in pod:
        raise Malformed("it has no status")
    status = _mapping(pod, "status", "")
    phase = _field(status, "phase", str, "status.")
    ip = _field(status, "podIP", str, "status.")
    host = _host(ip) if ip else None
    ready = _ready(status)
    terminating = metadata.get("deletionTimestamp") is not None
    if phase != "Running" or not ready or terminating or host is None:
        return None
    return ReadyPod(host, dict(labels))


def _port(entry: Any) -> int | None:
    number = entry.get("number") if isinstance(entry, dict) else None
    if isinstance(number, int) and not isinstance(number, bool) and 0 < number <= _MAX_PORT:
        return number
    return None


def pool_spec(pool: dict[str, Any]) -> PoolSpec:
    """An InferencePool's selector and target ports; out-of-range ports are refused here."""
    spec = _mapping(pool, "spec", "")
    if not spec:
        raise Malformed("it has no spec")
    selector = _mapping(spec, "selector", "spec.")
    match_labels = _labels(selector, "matchLabels", "spec.selector.")
    ports: list[int] = []
    refused: list[str] = []
    for entry in _field(spec, "targetPorts", list, "spec.") or []:
        port = _port(entry)
        if port is None:
            refused.append(repr(entry.get("number") if isinstance(entry, dict) else entry)[:32])
        elif port not in ports:
            ports.append(port)
    labels = ",".join(f"{key}={value}" for key, value in sorted(match_labels.items()))
    return PoolSpec(labels, tuple(ports), tuple(refused))
