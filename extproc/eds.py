"""Envoy's pool membership as EDS files, written by the ext_proc: one source for both.

With `up`, the decode_pool and prefill_pool clusters read their endpoints from files in the run
directory, which Envoy watches. Whatever the ext_proc's discovery finds (static lists, DNS,
Kubernetes, a reload) is written here first, so Envoy can only ever route to the endpoints the
ext_proc picks from. A file is replaced by rename, which is what Envoy's watch reacts to and
what keeps it from reading half a file.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["eds_path", "write_eds"]

_ASSIGNMENT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
_versions = itertools.count(1)


def eds_path(directory: Path, cluster: str) -> Path:
    return directory / f"eds-{cluster}.yaml"


def _endpoint(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    socket = {"address": host.strip("[]"), "port_value": int(port)}
    return {"endpoint": {"address": {"socket_address": socket}}}


def write_eds(directory: Path, cluster: str, addresses: Sequence[str]) -> Path:
    """Atomically (re)write `cluster`'s endpoints; returns the file Envoy watches."""
    response = {
        "version_info": str(next(_versions)),
        "resources": [
            {
                "@type": _ASSIGNMENT,
                "cluster_name": cluster,
                "endpoints": [{"lb_endpoints": [_endpoint(a) for a in addresses]}],
            }
        ],
    }
    target = eds_path(directory, cluster)
    staging = directory / f".{target.name}.tmp"
    staging.write_text(yaml.safe_dump(response, sort_keys=False))
    staging.rename(target)
    return target
