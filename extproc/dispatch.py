"""Which way a request's two legs leave, decided from the mode and what is known of P.

| mode        | identity cached          | strategy | reason       |
|-------------|--------------------------|----------|--------------|
| pull        | any                      | serial   | pull         |
| serial_push | any                      | serial   | serial_only  |
| any         | endpoint is flapping     | serial   | serial_only  |
| auto, push  | no                       | serial   | cache_miss   |
| auto        | yes, transfer_mode≠push  | serial   | pull         |
| auto, push  | yes (push)               | parallel | cache_hit    |

Serial: wait for P, forward its kv_transfer_params verbatim to D (works for pull and push).
Parallel: D gets the cached identity while P computes; both legs leave in one loop turn.
"""

from __future__ import annotations

from enum import StrEnum

from extproc.config import DispatchMode
from extproc.identity import PrefillIdentity

__all__ = ["Strategy", "choose_strategy"]


class Strategy(StrEnum):
    PARALLEL = "parallel"
    SERIAL = "serial"
    DECODE_ONLY = "decode_only"  # no healthy P and `no_healthy_prefill: decode_only`


def choose_strategy(
    mode: DispatchMode, identity: PrefillIdentity | None, serial_only: bool
) -> tuple[Strategy, str]:
    if mode is DispatchMode.PULL:
        return Strategy.SERIAL, "pull"
    if mode is DispatchMode.SERIAL_PUSH or serial_only:
        return Strategy.SERIAL, "serial_only"
    if identity is None:
        return Strategy.SERIAL, "cache_miss"
    if mode is DispatchMode.AUTO and identity.transfer_mode != "push":
        return Strategy.SERIAL, "pull"
    return Strategy.PARALLEL, "cache_hit"
