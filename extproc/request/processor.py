"""One client request through its phases: headers → body (dispatch) → response → end.

1. request headers: route check (404/405), the client's key where P would not check it (401,
   `extproc.request.client_key`); Envoy holds the headers until they are answered
2. request body, whole: parse once, then one call plans it (`extproc.request.plan`: P and D
   from the scheduler, the strategy, the bodies); its runner (`extproc.request.strategies`)
   sends the legs:
     parallel: start the P leg, let it write its request, then write D's answers
     serial:   await P, forward its params to D
   Streamed (FULL_DUPLEX_STREAMED, what the rendered LLM routes use): the chunks are gathered
   while the headers wait (`extproc.request.upload`), then the headers are answered (destination,
   request id, content-length) and the new body follows. Buffered (a filter without the
   per-route override, e.g. an older snippet): the headers are let through at once, the body
   comes whole and its answer carries the headers too. Envoy tells which in its first message.
3. until the stream ends: watch the P leg and D's response headers together;
   a failed P ends the request (ImmediateResponse) and Envoy resets D; a failed D
   cancels P; the stream ending (done or client gone) cancels a running P.
   D's successful response headers are held until a parallel P leg is settled.

The request's outcome (the `requests` metric label and the log line) is decided once, at
the end, from what happened: the error that ended it, Envoy's own reply, D's status. An answer
whose 2xx headers passed is counted from Envoy's access-log entry instead, when Envoy streams
one here: only Envoy sees whether the client got all of it (`extproc.request.access_log`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from extproc.errors import (
    ClientError,
    KvMismatch,
    LegError,
    PrefillFailed,
    RequestEnded,
    Shed,
    is_client_error,
)
from extproc.policies import PickRequest
from extproc.request import envoy_msgs
from extproc.request.access_log import AccessLogStreams
from extproc.request.body_budget import BodyBudget
from extproc.request.client_key import check_client_key
from extproc.request.parse import check_route, client_request, decode_request, is_passthrough
from extproc.request.plan import (
    NOT_PLANNED,
    NoPlan,
    ParallelPlan,
    Plan,
    SerialPlan,
    Strategy,
    land_on_decode,
    plan_request,
    request_tokens,
)
from extproc.request.strategies import (
    NOT_DISPATCHED,
    Dispatch,
    Exchange,
    LegServices,
    start_dispatch,
)
from extproc.request.stream import EnvoyStream
from extproc.request.upload import Upload, UploadLimits, gather_body
from extproc.scheduling.admission import request_priority
from extproc.scheduling.subset_hint import Subset, subset_hint

if TYPE_CHECKING:
    from extproc.config import Config, EndpointPickerConfig
    from extproc.metrics import Metrics
    from extproc.scheduling.scheduler import Scheduler
    from extproc.tracing import RequestTrace

__all__ = ["RequestDeps", "RequestProcessor"]

log = logging.getLogger("extproc.request.parse")

_BODY_WAIT_S = 300.0  # a slow client upload; Envoy's own idle timeout usually ends it first
_FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass(frozen=True, slots=True)
class RequestDeps:
    """What a request needs from the process; built once by the wiring."""

    legs: LegServices
    scheduler: Scheduler  # picks the endpoints, admits, decides decode-only
    new_trace: Callable[[], RequestTrace]
    metrics: Metrics
    config: Callable[[], Config]  # the current config: a reload swaps it, read once a request
    # `pd-extproc epp`: read the gateway's subset hint, answer the destination as metadata too
    endpoint_picker: bool = False
    # the `model` label of a model name, whether D accepted the request (bounded by the wiring)
    model_label: Callable[[str, bool], str] = lambda model, accepted: model
    # (prefill, decode) → the client's message when the probe saw them fail to exchange KV
    kv_mismatch: Callable[[str, str], str | None] = lambda prefill, decode: None
    # Envoy's access log to this process: an answer that started is counted from its entry
    access_log: AccessLogStreams = field(default_factory=AccessLogStreams)
    # the client bodies this process holds (limits.max_body_bytes_in_flight)
    bodies: BodyBudget = field(default_factory=BodyBudget)


_PASSED_THROUGH = NoPlan(Strategy.DECODE_ONLY, "passthrough")
_UNPLANNED = "none"  # the strategy label of a request that ran no leg


class RequestProcessor:
    """Per-stream phase handling; the dispatch it starts is closed (P cancelled) at the end."""

    def __init__(self, deps: RequestDeps, stream: EnvoyStream) -> None:
        self.deps = deps
        # The request's config from start to end: a reload meanwhile is for the next requests.
        self.config = deps.config()
        self.stream = stream
        self.trace = deps.new_trace()
        self.client_request_id = ""
        self.subset: Subset | None = None  # the gateway's subset hint (endpoint picker)
        self.plan: Plan | NoPlan = NOT_PLANNED
        self.dispatch: Dispatch = NOT_DISPATCHED
        # What happened, from which the outcome is decided once (`outcome`):
        self.error: RequestEnded | None = None
        self.envoy_replied = False  # Envoy answered the client itself (e.g. its 413)
        self.decode_status = 0  # D's response status, 0 until it arrives
        self.model = ""  # the client's model name, once the body is parsed
        self.counted_by_access_log = False  # D's 2xx passed: Envoy's entry tells the outcome
        self.withheld = False  # D's headers were never let through: the stream ended first
        self.reserved = deps.bodies.reservation()  # the body's bytes, until the request ends

    @property
    def outcome(self) -> str:
        """What the client got, as far as the ext_proc saw (docs/metrics.md lists them)."""
        if self.error is not None:
            error = self.error
            if isinstance(error, PrefillFailed) and is_client_error(error.status):
                return "client_error"  # P refused the client's request (unknown model, ...)
            return error.label if isinstance(error, LegError | Shed) else "client_error"
        if self.envoy_replied:
            return "client_error"
        if self.decode_status:
            status = self.decode_status
            if status < 400:
                return "cancelled" if self.withheld else "ok"
            return "client_error" if is_client_error(status) else f"decode_{status // 100}xx"
        return "cancelled"

    async def run(self) -> None:
        try:
            with ExitStack() as inflight:
                await self._run(inflight)
        except RequestEnded as error:
            # Kept without its traceback, whose frames hold this processor: the cycle would
            # keep the request's stream, and what gRPC holds of its body, until a collection.
            self.error = error.with_traceback(None)
            error.__context__ = error.__cause__ = None
            await self._end(error)
        finally:
            self.reserved.release()
            client_gone = self.stream.ended and self.error is None and not self.decode_status
            self.dispatch.close(client_gone)
            self.stream.close()
            plan, outcome = self.plan, self.outcome
            if self.counted_by_access_log:
                self.deps.access_log.awaiting += 1
            else:
                labels = (outcome, self._strategy, plan.reason, self._model_label())
                metrics = self.deps.metrics
                metrics.series(metrics.requests, *labels).inc()
            fields = self._log_fields(outcome)
            self.trace.finish(fields)
            if self.config.log.requests and plan.request_id:
                log.info("request %s %s", plan.request_id, outcome, extra=fields)

    @property
    def _strategy(self) -> str:
        """How the legs went; "none" before a plan: refused before any leg (or the client
        left), as Envoy's access-log entry of such a request says too."""
        return _UNPLANNED if self.plan is NOT_PLANNED else str(self.plan.strategy)

    def _log_fields(self, outcome: str) -> dict[str, object]:
        return {
            "request_id": self.plan.request_id,
            "client_request_id": self.client_request_id,
            "strategy": self._strategy,
            "reason": self.plan.reason,
            "outcome": outcome,
            "prefill": self.plan.prefill,
        }

    async def _end(self, error: RequestEnded) -> None:
        if isinstance(error, LegError):
            log.warning(
                "request %s (client id %r) failed: %s",
                self.plan.request_id,
                self.client_request_id,
                error,
                extra=self._log_fields(self.outcome),
            )
        if not self.stream.ended:
            # After D's 2xx passed, Envoy resets the stream and its access-log entry counts the
            # request: it is told the outcome, which its response flags would not say.
            outcome = reason = None
            if self.counted_by_access_log and isinstance(error, LegError):
                outcome, reason = error.label, self.plan.reason
            answer = envoy_msgs.immediate(error, self._labels(), reason, outcome)
            await self.stream.write(answer)

    def _labels(self) -> envoy_msgs.Labels:
        """The labels of the client-side metrics, for Envoy's access-log entry."""
        strategy = _UNPLANNED if isinstance(self.plan, NoPlan) else str(self.plan.strategy)
        return strategy, self._model_label()

    def _model_label(self) -> str:
        return self.deps.model_label(self.model, 0 < self.decode_status < 400)

    async def _run(self, inflight: ExitStack) -> None:
        message = await self.stream.read(_BODY_WAIT_S)
        if message is None or message.WhichOneof("request") != "request_headers":
            return
        headers = envoy_msgs.header_map(message.request_headers)
        self.client_request_id = headers.get("x-request-id", "")
        self.trace.join_client(headers.get("traceparent"), headers.get("tracestate"))
        config = self.config
        picker = config.endpoint_picker if self.deps.endpoint_picker else None
        if picker is not None:
            self.subset = subset_hint(message, picker.subset_hint_namespace)
        names = config.dispatch.forward_headers
        forwarded = {name: headers[name] for name in names if name in headers}
        single = envoy_msgs.repeated_headers(message.request_headers, names)
        forwarded |= single
        method, path = headers.get(":method", ""), headers.get(":path", "")
        if picker is not None and is_passthrough(method, path):
            await self._pass_through(picker, headers, inflight)
            return
        api = check_route(method, path)
        check_client_key(headers, config)  # before the upload, before any leg
        if message.request_headers.end_of_stream:
            raise ClientError(400, "the request has no body; send a JSON object")
        streamed = message.protocol_config.request_body_mode == _FULL_DUPLEX
        upload = await (self._streamed_body() if streamed else self._buffered_body())
        if upload is None:
            return
        started = time.perf_counter()
        dispatch = config.dispatch
        turns, size = self.deps.legs.turns, len(upload.body)  # a big body's steps take turns
        async with turns.turn(size):
            doc = decode_request(api, upload.body, config.limits.max_body_bytes)
        async with turns.turn(size):
            request = client_request(api, upload.body, doc, dispatch.client_engine_priority)
        self.model = request.model
        fallbacks = 1 if picker is None else picker.fallbacks
        tokens = await request_tokens(request, self.deps.scheduler)  # None: not KV-routed
        async with turns.turn(size):
            self.plan = plan = plan_request(
                request,
                headers,
                config,
                self.deps.scheduler,
                self.deps.legs.identities,
                inflight,
                self.subset,
                fallbacks,
                tokens,
            )
        exchange = Exchange(
            self.stream,
            self.trace,
            api.value,
            forwarded,
            self.client_request_id,
            config,
            streamed,
            picker.destination_namespace if picker else None,
            single_headers=single or None,
            stream_answer=request.stream,
        )
        self.dispatch = start_dispatch(plan, self.deps.legs, exchange, plan.prefill_counted)
        del doc, request  # the decoded body (a long prompt: megabytes) is done with
        if await self.dispatch.send(started):
            await self._watch()

    async def _pass_through(
        self, picker: EndpointPickerConfig, headers: Mapping[str, str], inflight: ExitStack
    ) -> None:
        """Endpoint picker: an engine's own endpoint (GET /v1/models, POST /tokenize, ...), which
        the gateway routes through the picker too, goes to a decode as it is (admitted at the
        request's priority, as every request; without the sidecar's own headers); its bodies
        pass."""
        self.plan = _PASSED_THROUGH  # its labels, should no D be picked
        scheduler, config = self.deps.scheduler, self.config
        priority = request_priority(headers, config.admission, scheduler.count_invalid_priority)
        picked = scheduler.pick_decodes(
            PickRequest(priority=priority), inflight, config, self.subset, picker.fallbacks
        )
        self.plan = NoPlan(Strategy.DECODE_ONLY, picked.reason, picked.decode_counted)
        decodes = picked.decodes
        answer = envoy_msgs.destination_answer(decodes)
        envoy_msgs.with_destination_metadata(answer, decodes, picker.destination_namespace)
        await self.stream.write(answer)
        timeout_s = self.config.timeouts.request_s
        while (message := await self.stream.read(timeout_s)) is not None:
            kind = message.WhichOneof("request")
            if kind == "request_body":
                await self.stream.write(envoy_msgs.body_passthrough(message.request_body, True))
            elif kind == "request_trailers":
                await self.stream.write(envoy_msgs.continue_request_trailers())
            else:
                await self._on_message(message)

    async def _buffered_body(self) -> Upload | None:
        """Let the headers pass and take the body Envoy buffered whole (None: no body came)."""
        await self.stream.write(envoy_msgs.continue_request_headers())
        message = await self.stream.read(_BODY_WAIT_S)
        if message is None:
            return None
        if message.WhichOneof("request") != "request_body":
            await self._on_envoy_reply(message)
            return None
        body = message.request_body.body
        self.reserved.take(len(body), self.config.limits.body_budget_bytes)
        return Upload(body)

    async def _streamed_body(self) -> Upload | None:
        """Gather the streamed body while the headers wait for their answer (None: no body)."""
        limits, timeouts = self.config.limits, self.config.timeouts
        upload = await gather_body(
            self.stream,
            UploadLimits(
                limits.max_body_bytes,
                limits.body_budget_bytes,
                timeouts.upload_idle_s,
                timeouts.upload_s,
            ),
            self.reserved,
        )
        if upload is None:
            return None
        if upload.envoy_reply is not None:
            await self._on_envoy_reply(upload.envoy_reply)
            return None
        if upload.trailers:
            # Tried through Envoy 1.40: D then got a misframed request (its engine answered
            # 400 to the body's bytes), so they are refused before any leg leaves.
            raise ClientError(400, "request trailers are not supported; send the body alone")
        return upload

    async def _on_envoy_reply(self, message: Any) -> None:
        """Envoy answered the client itself (413 for a body over its buffer limit): the local
        reply passes through our response phase and is let through."""
        await self._on_message(message)
        self.envoy_replied = True

    async def _watch(self) -> None:
        """Until the stream ends: P leg outcome and D's response headers, whichever first."""
        timeout_s = self.config.timeouts.request_s
        while not self.stream.ended:
            leg = self.dispatch.watch()  # raises P's failure once known
            if leg is None:  # Envoy's next message alone: no task, no wait set
                message = await self.stream.read(timeout_s)
                if message is None and not self.stream.ended:
                    return  # request_s elapsed: stop watching, Envoy's timeouts own it now
                await self._on_message(message)
                continue
            read = self.stream.next_message()
            done, _ = await asyncio.wait(
                {read, leg}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                return
            if read.done():
                await self._on_message(self.stream.take())

    async def _on_message(self, message: Any) -> None:
        kind = None if message is None else message.WhichOneof("request")
        if kind == "response_body":  # a gateway streams D's answer through us: pass it on
            await self.stream.write(envoy_msgs.body_passthrough(message.response_body, False))
            return
        if kind == "response_trailers":  # streamed routes and gateways ask for them
            await self.stream.write(envoy_msgs.continue_response_trailers())
            return
        if kind != "response_headers":
            return
        status = envoy_msgs.status_of(message.response_headers)
        served = envoy_msgs.served_endpoint(message)
        counted = self.plan.decode_counted
        if served and counted is not None:
            counted.move_to(served)  # a fallback served it: count it there
        self.decode_status = status
        self.trace.decode_answered(status)
        reached = envoy_msgs.decode_was_reached(message)
        if reached:
            self._check_kv_mismatch(status, served)
        if await self.dispatch.on_decode_headers(status, reached):
            if status < 400:
                land_on_decode(self.plan, self.deps.scheduler.kv, served)
            # An answer that started may still be cut; only Envoy's access log will know.
            by_log = status < 400 and self.deps.access_log.decide_outcomes
            reason = self.plan.reason if by_log else None
            # Decided before the write: Envoy may end the stream while the answer is flushed
            # (the task cancelled in the write), and its entry still counts the request.
            self.counted_by_access_log = by_log
            try:
                await self.stream.write(
                    envoy_msgs.continue_response_headers(self._labels(), reason)
                )
            except Exception:
                self.counted_by_access_log = False  # it never reached Envoy: count it here
                raise
        else:
            self.withheld = True  # the stream ended while they were held: the client left

    def _check_kv_mismatch(self, status: int, served: str | None) -> None:
        """D failed a pair known not to exchange KV: the client learns why, not a bare 500."""
        plan = self.plan
        if status < 500 or not isinstance(plan, ParallelPlan | SerialPlan):
            return
        message = self.deps.kv_mismatch(plan.prefill, served or plan.decodes[0])
        if message is not None:
            raise KvMismatch(502, message)
