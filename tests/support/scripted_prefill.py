"""Stand-ins for the P leg (the prefill client the processor calls), each controlled another way,
and a runtime whose P legs go to one of them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Coroutine
from typing import Any

import orjson

from extproc.config import parse_config
from extproc.protocol.identity import identity_from_params
from extproc.request.prefill_client import PrefillCall, PrefillResult
from extproc.request.processor import RequestProcessor
from extproc.request.stream import EnvoyStream
from extproc.wiring import Runtime
from tests.support.scripted_envoy import D1, IDENTITY, P, ScriptedEnvoy


class Prefill:
    """The P leg: each call waits for the test's `answer` or `fail`; cancellation is seen."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.called = asyncio.Event()
        self.cancelled = False

    async def send(self, call: PrefillCall) -> PrefillResult:
        # (endpoint, path, body, request_id, timeout_s, headers)
        self.calls.append(dataclasses.astuple(call))
        self.called.set()
        try:
            outcome = await self.outcome
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if isinstance(outcome, Exception):
            raise outcome
        return PrefillResult(200, outcome, 0.0, 0.125)

    def answer(self, params: Any) -> None:
        self.outcome.set_result(params)

    def fail(self, error: Exception) -> None:
        self.outcome.set_exception(error)

    @property
    def body(self) -> dict[str, Any]:
        return orjson.loads(self.calls[0][2])


class FakePrefill:
    """P answers after `outcome` seconds of compute, or raises `outcome` if it is an error;
    a shared `timeline` records when the leg is created and when it is sent."""

    def __init__(self, outcome: Any, timeline: list[str] | None = None) -> None:
        self.outcome = outcome
        self.calls = 0
        self.timeline = [] if timeline is None else timeline

    def send(self, *args: Any, **kwargs: Any) -> Coroutine[Any, Any, PrefillResult]:
        """Called when the processor creates the leg; the returned coroutine is the request."""
        self.calls += 1
        self.timeline.append("P leg created")
        return self._answer()

    async def _answer(self) -> PrefillResult:
        self.timeline.append("P leg sent")
        if isinstance(self.outcome, Exception):
            raise self.outcome
        await asyncio.sleep(self.outcome)  # P's compute time
        return PrefillResult(200, IDENTITY | {"remote_request_id": "x"}, 0.0, self.outcome)


class GatedPrefill:
    """P answers `params` only once the test opens the gate."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params
        self.gate = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def send(self, *args: Any, **kwargs: Any) -> PrefillResult:
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return PrefillResult(200, self.params, 0.0, 0.0)


def runtime(
    prefill: FakePrefill, cached: bool, decodes: tuple[str, ...] = (D1,), **settings: Any
) -> Runtime:
    """A runtime over one P and `decodes`; `settings`: more config sections (timeouts, ...)."""
    pools = {"prefill": {"endpoints": [P]}, "decode": {"endpoints": list(decodes)}}
    rt = use_prefill(Runtime(parse_config(pools | settings), "unix:/nonexistent"), prefill)
    if cached:
        rt.identities.learn(P, identity_from_params(IDENTITY))
    return rt


def use_prefill(rt: Runtime, prefill: Any) -> Runtime:
    """The runtime with its P legs sent to a fake instead of Envoy's prefill listener."""
    legs = dataclasses.replace(rt.request_deps.legs, prefill_client=prefill)
    rt.request_deps = dataclasses.replace(rt.request_deps, legs=legs)
    return rt


async def run(rt: Runtime, envoy: ScriptedEnvoy) -> asyncio.Task[None]:
    """The processor of one request, reading from and answering `envoy`, as a task."""
    stream = EnvoyStream(envoy)  # type: ignore[arg-type]
    return asyncio.create_task(RequestProcessor(rt.request_deps, stream).run())
