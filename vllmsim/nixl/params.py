"""kv_transfer_params of the vLLM 0.33 shape: built on P, validated on D.

Key order follows 0.33's `request_finished()` dicts (pull_scheduler.py /
push_scheduler.py) with `remote_prefill_cached_tokens` appended by the scheduler.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# D-side keys a pull consumer needs; a missing one means "Got invalid KVTransferParams"
# and local recompute (pull_scheduler.update_state_after_alloc).
PULL_REQUIRED = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
# D-side keys a push consumer indexes with params[...]: a missing one is a KeyError that
# kills vLLM's EngineCore; the simulator answers 500 instead.
PUSH_REQUIRED = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_request_id")

_RANDOM_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$")


def side_channel_address(params: dict[str, Any]) -> tuple[str, int]:
    """P's side channel from D's params; a port that is no integer fails the transfer (the
    transfer's own error path), rather than an exception nobody awaits leaving D hanging."""
    port = params["remote_port"]
    if isinstance(port, bool) or not isinstance(port, int | str) or not str(port).isdigit():
        raise ValueError(f"remote_port {port!r} is not a port number")
    return str(params["remote_host"]), int(port)


def base_request_id(request_id: str) -> str:
    """Strip one trailing `-<8 hex>` engine suffix, like vLLM's get_base_request_id."""
    return _RANDOM_SUFFIX_RE.sub("", request_id)


@dataclass(frozen=True)
class Identity:
    """What P advertises about itself in every response."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1


def prefill_params(
    ident: Identity,
    mode: str,
    block_ids: list[int],
    request_id: str,
    num_tokens: int,
    registration_generation: int = 0,
    names_mode: bool = True,
) -> dict[str, Any]:
    """P's response params after its 1-token step (`names_mode` False: without transfer_mode,
    as vLLM before 0.28)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],  # one list per KV-cache group
        "remote_engine_id": ident.engine_id,
        "remote_request_id": request_id,
        "remote_host": ident.host,
        "remote_port": ident.port,
        "tp_size": ident.tp_size,
        "dcp_size": ident.dcp_size,
        "pp_size": ident.pp_size,
        "remote_num_tokens": num_tokens,
    }
    if mode == "pull":  # before transfer_mode, as in vLLM 0.32's pull scheduler
        params["remote_blocks_expiry_time"] = None
    if names_mode:
        params["transfer_mode"] = mode
    if mode == "pull":
        params["remote_registration_generation"] = registration_generation
    params["remote_prefill_cached_tokens"] = 0
    return params


def block_group(value: Any) -> list[int] | None:
    """The block ids of a `[[...]]` field (one list per KV-cache group; the simulator has one
    group), or None when it is not that shape."""
    if not isinstance(value, list) or not value or not isinstance(value[0], list):
        return None
    ids = value[0]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
        return None
    return list(ids)


def missing_keys(params: dict[str, Any], required: tuple[str, ...]) -> list[str]:
    return [key for key in required if params.get(key) is None]


def transfer_id(params: dict[str, Any] | None) -> str | None:
    """[main]'s pairing key: a non-empty string, else None."""
    value = (params or {}).get("transfer_id")
    return value if isinstance(value, str) and value else None
