"""Streams whose pushed KV may still be on its way, by the prefill engine that owes it.

In parallel push dispatch D's 200 headers pass once P has answered, but P writes the KV into
D's blocks only after that answer (its WRITE pairs the finished blocks with D's registration).
A P that restarts or dies in between never writes it, and D waits for it in silence: vLLM's
decode side has no timeout for a push that never lands (0.32's registration watchdog only
logs), so only Envoy's idle timeout (`timeouts.kv_wait_s`) would end the stream.

So a request whose headers passed is registered here with P's endpoint (with its
data-parallel rank, as `identity.where` names it: each rank is an engine of its own) and engine
id. When the
sidecar learns that the endpoint now runs another engine (a new identity from any answer or
the probe) or went down (a failed health check, a refused connection), the streams that engine
may not have written are told, and each request ends its stream at once (Envoy resets it)
instead of leaving it silent. A push lands within `landing_s` (`timeouts.pushed_kv_s`) of P's
answer while P lives, so a stream counts as written once its engine was seen alive (a later
answer with the same engine id) that long after its own answer: under load, only the streams
P answered just before it went are ended. With no such sign (an idle P), every stream it
answered within `landing_s` plus the time a loss takes to be seen (`keep_s`) is ended: the
ext_proc never sees D's body, so it cannot tell a stream still waiting from one whose KV
landed; the cost of a restart, bounded by the window.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Owed", "PushedKv"]

Clock = Callable[[], float]


@dataclass(eq=False, slots=True)
class Owed:
    """One stream's push, owed by `engine_id` at `endpoint`: landed by `landed_by` if the engine
    lives until then; forgotten after `kept_until`. `lost` is done once it is known lost."""

    endpoint: str
    engine_id: str
    landed_by: float
    kept_until: float
    lost: asyncio.Future[None]


class PushedKv:
    """The owed pushes of this process's open streams, by prefill endpoint (bounded by them:
    each stream holds one at most and releases it when it ends), and when each endpoint's
    engine was last seen alive (one entry per prefill endpoint)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._owed: dict[str, set[Owed]] = {}
        self._alive: dict[str, tuple[str, float]] = {}  # endpoint -> (engine id, when)
        self._clock = clock

    def owe(self, endpoint: str, engine_id: str, landing_s: float, keep_s: float) -> Owed:
        now, lost = self._clock(), asyncio.get_running_loop().create_future()
        owed = Owed(endpoint, engine_id, now + landing_s, now + max(landing_s, keep_s), lost)
        self._owed.setdefault(endpoint, set()).add(owed)
        return owed

    def release(self, owed: Owed) -> None:
        owing = self._owed.get(owed.endpoint)
        if owing is not None:
            owing.discard(owed)
            if not owing:
                del self._owed[owed.endpoint]

    def seen_alive(self, endpoint: str, engine_id: str) -> None:
        """`engine_id` answered at `endpoint` just now (P's answer carried its identity)."""
        self._alive[endpoint] = (engine_id, self._clock())

    def forget(self, endpoint: str) -> None:
        """The endpoint left the pool."""
        for key in _of(endpoint, self._alive):
            del self._alive[key]

    def engine_changed(self, endpoint: str, engine_id: str) -> int:
        """`endpoint` now runs `engine_id`: the pushes another engine owed there are lost."""
        return self._lose(endpoint, lambda owed: owed.engine_id != engine_id)

    def endpoint_down(self, endpoint: str) -> int:
        """`endpoint` stopped answering: every push it owed is lost, on each of its ranks."""
        return sum(self._lose(key, lambda owed: True) for key in _of(endpoint, self._owed))

    def _lose(self, endpoint: str, gone: Callable[[Owed], bool]) -> int:
        """Tell the streams whose push may not have landed; how many."""
        now, told = self._clock(), 0
        alive_engine, alive_at = self._alive.get(endpoint, ("", 0.0))
        for owed in list(self._owed.get(endpoint, ())):
            if not gone(owed):
                continue
            self.release(owed)
            written = alive_engine == owed.engine_id and alive_at >= owed.landed_by
            if not written and now <= owed.kept_until and not owed.lost.done():
                owed.lost.set_result(None)
                told += 1
        return told

    def __len__(self) -> int:
        return sum(len(owing) for owing in self._owed.values())


def _of(endpoint: str, keys: Iterable[str]) -> list[str]:
    """The keys that name `endpoint` or one of its ranks."""
    return [key for key in keys if key == endpoint or key.startswith(endpoint + " dp")]
