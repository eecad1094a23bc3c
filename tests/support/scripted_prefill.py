"""A stand-in for the P leg (the prefill client the processor calls), scripted by the test, and a
runtime whose P legs go to it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any

import orjson

from extproc.protocol.identity import identity_from_params
from extproc.request.prefill_client import PrefillCall, PrefillResult
from extproc.request.processor import RequestProcessor
from extproc.request.stream import EnvoyStream
from extproc.wiring import Runtime
from tests.support.routing import fixed_routing_config
from tests.support.scripted_envoy import D1, IDENTITY, WAIT_S, P, ScriptedEnvoy


class ScriptedPrefill:
    """The P leg the processor calls (its PrefillSender), answered as the test scripts it.

    Each leg takes the next outcome of `script`, given up front: the kv_transfer_params P
    answers with (after `compute_s` of compute), or the error it raises at once. Once the
    script has run out, a leg waits for the test's `answer(params)` or `fail(error)`, which
    every later leg gets too. Each leg is recorded in `calls` and sets `called`; `cancelled` is
    set when one is cancelled before it answered. A `timeline` shared with a ScriptedEnvoy
    records when the leg is created and when it is sent.
    """

    ELAPSED_S = 0.125  # the time every answer says P took

    def __init__(
        self, *script: Any, compute_s: float = 0.0, timeline: list[str] | None = None
    ) -> None:
        self.calls: list[PrefillCall] = []
        self.called = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.timeline = [] if timeline is None else timeline
        self._script = list(script)
        self._compute_s = compute_s
        self._outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def send(self, call: PrefillCall) -> Coroutine[Any, Any, PrefillResult]:
        """Called when the processor creates the leg; the returned coroutine is the request."""
        self.calls.append(call)
        self.called.set()
        self.timeline.append("P leg created")
        return self._leg(self._script.pop(0) if self._script else None)

    async def _leg(self, scripted: Any) -> PrefillResult:
        self.timeline.append("P leg sent")
        try:
            if scripted is None:
                outcome = await asyncio.shield(self._outcome)  # a cancelled leg leaves it unset
            elif isinstance(scripted, Exception):
                raise scripted
            else:
                await asyncio.sleep(self._compute_s)  # P's compute time
                outcome = scripted
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if isinstance(outcome, Exception):
            raise outcome
        return PrefillResult(200, outcome, 0.0, self.ELAPSED_S)

    async def until_called(self, count: int = 1) -> list[PrefillCall]:
        """Wait (bounded) until `count` legs have been sent; the calls so far."""
        while len(self.calls) < count:
            self.called.clear()
            await asyncio.wait_for(self.called.wait(), WAIT_S)
        return self.calls

    def answer(self, params: Any) -> None:
        self._outcome.set_result(params)

    def fail(self, error: Exception) -> None:
        self._outcome.set_result(error)

    @property
    def body(self) -> dict[str, Any]:
        """The first leg's body."""
        return orjson.loads(bytes(self.calls[0].body))


def runtime(
    prefill: ScriptedPrefill, cached: bool, decodes: tuple[str, ...] = (D1,), **settings: Any
) -> Runtime:
    """A runtime over one P and `decodes`; `settings`: more config sections (timeouts, ...)."""
    pools = {"prefill": {"endpoints": [P]}, "decode": {"endpoints": list(decodes)}}
    rt = use_prefill(Runtime(fixed_routing_config(pools | settings), "unix:/nonexistent"), prefill)
    if cached:
        rt.identities.learn(P, identity_from_params(IDENTITY))
    return rt


def use_prefill(rt: Runtime, prefill: ScriptedPrefill) -> Runtime:
    """The runtime with its P legs sent to a fake instead of Envoy's prefill listener."""
    legs = dataclasses.replace(rt.request_deps.legs, prefill_client=prefill)
    rt.request_deps = dataclasses.replace(rt.request_deps, legs=legs)
    return rt


async def run(rt: Runtime, envoy: ScriptedEnvoy) -> asyncio.Task[None]:
    """The processor of one request, reading from and answering `envoy`, as a task."""
    stream = EnvoyStream(envoy)  # type: ignore[arg-type]
    return asyncio.create_task(RequestProcessor(rt.request_deps, stream).run())
