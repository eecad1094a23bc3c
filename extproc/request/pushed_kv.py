"""Streams whose pushed KV may still be on its way, by the prefill engine that owes it.

In parallel push dispatch D's 200 headers pass once P has answered, but P writes the KV into
D's blocks only after that answer (its WRITE pairs the finished blocks with D's registration).
A P that restarts or dies in between never writes it, and D waits for it in silence: vLLM's
decode side has no timeout for a push that never lands (0.32's registration watchdog only
logs), so only Envoy's idle timeout (`timeouts.kv_wait_s`) would end the stream.

So a request whose headers passed is registered here with P's endpoint and engine id for
`timeouts.pushed_kv_s` after P's answer. When the sidecar learns that the endpoint now runs
another engine (a new identity from any answer or the probe) or went down (a failed health
check, a refused connection), every stream that engine still owed a push within that window
is told, and the request ends it at once (Envoy resets the started stream) instead of leaving
it silent. The ext_proc never sees D's body, so it cannot tell a stream still waiting from one
whose KV landed a moment before the restart: within the window both are ended, a bounded cost
paid on a restart only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Owed", "PushedKv"]

Clock = Callable[[], float]


@dataclass(eq=False, slots=True)
class Owed:
    """One stream's push, owed by `engine_id` at `endpoint` until `until` (the clock's time).
    `lost` is done when that engine is known to be gone before then."""

    endpoint: str
    engine_id: str
    until: float
    lost: asyncio.Future[None]


class PushedKv:
    """The owed pushes of this process's open streams, by prefill endpoint (bounded by them:
    each stream holds one at most and releases it when it ends)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._owed: dict[str, set[Owed]] = {}
        self._clock = clock

    def owe(self, endpoint: str, engine_id: str, window_s: float) -> Owed:
        lost = asyncio.get_running_loop().create_future()
        owed = Owed(endpoint, engine_id, self._clock() + window_s, lost)
        self._owed.setdefault(endpoint, set()).add(owed)
        return owed

    def release(self, owed: Owed) -> None:
        owing = self._owed.get(owed.endpoint)
        if owing is not None:
            owing.discard(owed)
            if not owing:
                del self._owed[owed.endpoint]

    def engine_changed(self, endpoint: str, engine_id: str) -> int:
        """`endpoint` now runs `engine_id`: the pushes another engine owed there are lost."""
        return self._lose(endpoint, lambda owed: owed.engine_id != engine_id)

    def endpoint_down(self, endpoint: str) -> int:
        """`endpoint` stopped answering: every push it owed is lost."""
        return self._lose(endpoint, lambda owed: True)

    def _lose(self, endpoint: str, gone: Callable[[Owed], bool]) -> int:
        """Tell the streams of the lost pushes still within their window; how many."""
        now, told = self._clock(), 0
        for owed in list(self._owed.get(endpoint, ())):
            if not gone(owed):
                continue
            self.release(owed)
            if now <= owed.until and not owed.lost.done():
                owed.lost.set_result(None)
                told += 1
        return told

    def __len__(self) -> int:
        return sum(len(owing) for owing in self._owed.values())
