"""One client request through its phases: headers → body (dispatch) → response → end.

1. request headers: route check (404/405), answer CONTINUE (Envoy holds the headers)
2. request body (BUFFERED, whole): parse once, pick P and D, choose the strategy,
   build both bodies by splicing, then
     parallel: start the P leg and answer the body message in the same loop turn
     serial:   extend Envoy's message timer, await P, forward its params to D
3. until the stream ends: watch the P leg and D's response headers together;
   a failed P ends the request (ImmediateResponse) and Envoy resets D; a failed D
   cancels P; the stream ending (done or client gone) cancels a running P.
   D's successful response headers are held until a parallel P leg is settled, so a P
   failure or a restart always reaches the client as a clean status (503 + Retry-After
   for a restart), never as a 200 that is then cut. This holds also when D could recompute
   the prompt itself (`kv_load_failure_policy: recompute`): the ext_proc sees neither D's
   policy nor its body, so it cannot tell a complete answer from an in-stream error, and a
   retry gets real P/D instead of a decode engine prefilling on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from extproc import envoy_msgs
from extproc.bodies import buffer_bytes, decode_body, prefill_body, prefill_kv_params
from extproc.dispatch import Strategy, choose_strategy
from extproc.errors import (
    ClientError,
    IdentityChanged,
    LegError,
    NoHealthyDecode,
    NoHealthyPrefill,
    PrefillFailed,
    PrefillTimeout,
    PrefillUnreachable,
    RequestEnded,
)
from extproc.identity import PrefillIdentity, identity_from_params
from extproc.picking import PickRequest
from extproc.prefill_leg import PrefillResult
from extproc.request import ClientRequest, check_route, parse_request
from extproc.stream import EnvoyStream

if TYPE_CHECKING:
    from extproc.wiring import Runtime

__all__ = ["RequestProcessor"]

log = logging.getLogger("extproc.request")

_BODY_WAIT_S = 300.0  # a slow client upload; Envoy's own idle timeout usually ends it first


class RequestProcessor:
    """Per-stream state and phase handling; `run` owns the P leg task and cancels it."""

    def __init__(self, runtime: Runtime, stream: EnvoyStream) -> None:
        self.rt = runtime
        self.stream = stream
        self.client_request_id = ""
        self.request_id = ""
        self.strategy = Strategy.SERIAL
        self.reason = "none"
        self.outcome = "cancelled"
        self.prefill: str | None = None
        self.given: PrefillIdentity | None = None  # identity D was given (parallel)
        self.leg: asyncio.Task[PrefillResult] | None = None
        self.forwarded: dict[str, str] = {}  # client headers the P leg carries too
        self.trace = runtime.tracing.request()

    async def run(self) -> None:
        try:
            with ExitStack() as inflight:
                await self._run(inflight)
        except RequestEnded as error:
            await self._end(error)
        finally:
            if self.leg is not None and not self.leg.done():
                self.leg.cancel()  # client gone or D finished/failed: P's work is useless
            elif self.leg is not None and not self.leg.cancelled():
                self.leg.exception()  # D answered first (its own error): P's is moot
            self.stream.close()
            self.rt.metrics.requests.labels(self.outcome, self.strategy, self.reason).inc()
            self.trace.finish(self._log_fields())
            if self.rt.config.log.requests and self.request_id:
                log.info("request %s %s", self.request_id, self.outcome, extra=self._log_fields())

    def _log_fields(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "strategy": str(self.strategy),
            "reason": self.reason,
            "outcome": self.outcome,
            "prefill": self.prefill,
        }

    async def _end(self, error: RequestEnded) -> None:
        self.outcome = error.label if isinstance(error, LegError) else "client_error"
        if isinstance(error, LegError):
            log.warning(
                "request %s (client id %r) failed: %s",
                self.request_id,
                self.client_request_id,
                error,
                extra=self._log_fields(),
            )
        if not self.stream.ended:
            await self.stream.write(envoy_msgs.immediate(error))

    async def _run(self, inflight: ExitStack) -> None:
        message = await self.stream.read(_BODY_WAIT_S)
        if message is None or message.WhichOneof("request") != "request_headers":
            return
        headers = envoy_msgs.header_map(message.request_headers)
        self.client_request_id = headers.get("x-request-id", "")
        forward = self.rt.config.dispatch.forward_headers
        self.forwarded = {name: headers[name] for name in forward if name in headers}
        api = check_route(headers.get(":method", ""), headers.get(":path", ""))
        if message.request_headers.end_of_stream:
            raise ClientError(400, "the request has no body; send a JSON object")
        await self.stream.write(envoy_msgs.continue_request_headers())
        message = await self.stream.read(_BODY_WAIT_S)
        if message is None:
            return
        if message.WhichOneof("request") != "request_body":
            # Envoy answered the client itself (413 for a body over its buffer limit): the
            # local reply passes through our response phase and is let through.
            await self._on_message(message)
            self.outcome = "client_error"
            return
        started = time.perf_counter()
        request = parse_request(
            api, message.request_body.body, self.rt.config.limits.max_body_bytes
        )
        session = headers.get(self.rt.config.dispatch.session_header)
        await self._dispatch(request, _pick_request(request, session), inflight, started)
        await self._watch()

    def _pick(self, wanted: PickRequest, inflight: ExitStack) -> tuple[list[str], str | None]:
        group = self.rt.group(wanted.model)
        decodes = self.rt.decode.pick_with_fallback(
            wanted, group.members["decode"], group.pickers["decode"]
        )
        if not decodes:
            raise NoHealthyDecode(503, "no healthy decode endpoint; retry later", retry_after_s=1)
        inflight.enter_context(self.rt.decode.track(decodes[0]))
        prefill = self.rt.prefill.pick(wanted, group.members["prefill"], group.pickers["prefill"])
        if prefill is not None:
            inflight.enter_context(self.rt.prefill.track(prefill))
            return [d.address for d in decodes], prefill.address
        if self.rt.config.dispatch.no_healthy_prefill == "decode_only":
            return [d.address for d in decodes], None
        raise NoHealthyPrefill(503, "no healthy prefill endpoint; retry later", retry_after_s=1)

    async def _dispatch(
        self, request: ClientRequest, wanted: PickRequest, inflight: ExitStack, started: float
    ) -> None:
        decodes, self.prefill = self._pick(wanted, inflight)
        self.request_id = str(uuid.uuid4())
        if self.prefill is None:
            self.strategy, self.reason = Strategy.DECODE_ONLY, "no_prefill"
            await self._answer(decode_body(request.parts, None), decodes, started)
            return
        cache = self.rt.identities
        identity = cache.get(self.prefill)
        mode = self.rt.prefill_mode(self.prefill)
        self.strategy, self.reason = choose_strategy(
            mode, identity, cache.serial_only(self.prefill)
        )
        transfer_id = f"xfer-{self.request_id}"  # unique per request, one uuid4 fewer
        p_body = prefill_body(
            request.parts, request.has_max_completion_tokens, prefill_kv_params(transfer_id)
        )
        if self.strategy is Strategy.PARALLEL:
            assert identity is not None
            self.given = identity
            d_body = decode_body(
                request.parts, identity.decode_params(self.request_id, transfer_id)
            )
            self._check_fits(p_body, d_body)
            # Created before the answer is written: both leave in this event-loop turn.
            self.leg = self._start_leg(request, p_body)
            await self._answer(d_body, decodes, started)
            self.rt.metrics.skew_seconds.observe(abs(time.perf_counter() - self._leg_started))
            return
        self._check_fits(p_body)
        await self.stream.write(envoy_msgs.extend_timeout(self.rt.config.timeouts.prefill_s + 1))
        waited = time.perf_counter()
        self.leg = self._start_leg(request, p_body)
        result = await self._await_serial_leg()
        if result is None:
            return  # the client went away while P computed
        started += time.perf_counter() - waited
        d_body = decode_body(request.parts, self._learn(result))
        self._check_fits(d_body)  # P's params are only known now
        await self._answer(d_body, decodes, started)

    def _check_fits(self, *bodies: bytes) -> None:
        """A body longer than Envoy's buffer would be refused there: refuse it before it leaves.

        Envoy's buffer leaves room for the splice (`buffer_bytes`), so only a serial D body
        with an unusually long list of P's KV blocks can get here.
        """
        limit = buffer_bytes(self.rt.config.limits.max_body_bytes)
        size = max(len(body) for body in bodies)
        if size > limit:
            raise ClientError(
                413,
                f"with its kv_transfer_params the body for an engine is {size} bytes, "
                f"over the proxy's buffer of {limit} bytes; send a shorter prompt",
            )

    def _start_leg(self, request: ClientRequest, body: bytes) -> asyncio.Task[PrefillResult]:
        assert self.prefill is not None
        self._leg_started = time.perf_counter()
        self.trace.prefill_started()
        return asyncio.create_task(
            self.rt.prefill_client.send(
                self.prefill,
                request.api.value,
                body,
                self.request_id,
                self.rt.config.timeouts.prefill_s,
                self.forwarded,
            )
        )

    async def _answer(self, body: bytes, decodes: list[str], started: float) -> None:
        await self.stream.write(envoy_msgs.body_answer(body, decodes, self.request_id))
        self.trace.decode_started()
        if self.prefill is not None:
            self.rt.kv_check.note_dispatch(decodes[0])
        self.rt.metrics.processing_seconds.observe(time.perf_counter() - started)
        log.debug(
            "request %s (client id %r): %s/%s P=%s D=%s",
            self.request_id,
            self.client_request_id,
            self.strategy,
            self.reason,
            self.prefill,
            decodes[0],
        )

    async def _await_serial_leg(self) -> PrefillResult | None:
        assert self.leg is not None
        read = self.stream.next_message()
        await asyncio.wait({self.leg, read}, return_when=asyncio.FIRST_COMPLETED)
        if self.leg.done():
            return self._leg_result()
        # Envoy sends nothing while it waits for our body answer, so this is the stream's end.
        self.stream.take()
        return None

    def _leg_result(self) -> PrefillResult:
        """The finished P leg's result; on failure drop the identity and raise for the client."""
        assert self.leg is not None and self.prefill is not None
        try:
            result = self.leg.result()
        except LegError as error:
            self.trace.prefill_finished(error.label)
            self.rt.metrics.prefill_seconds.labels(error.label).observe(
                time.perf_counter() - self._leg_started
            )
            if not _refused_request(error):
                self.rt.identities.drop(self.prefill)
            if isinstance(error, PrefillUnreachable):
                self.rt.prefill.set_healthy(self.prefill, False)
            raise
        self.rt.metrics.prefill_seconds.labels("ok").observe(result.elapsed_s)
        self.trace.prefill_finished("ok")
        return result

    def _learn(self, result: PrefillResult) -> dict[str, Any]:
        """Validate P's params (never forward unchecked values) and refresh the cache."""
        assert self.prefill is not None
        try:
            identity = identity_from_params(result.kv_transfer_params)
        except ValueError as error:
            self.rt.identities.drop(self.prefill)
            raise PrefillFailed(
                502, f"prefill {self.prefill} sent unusable params: {error}"
            ) from None
        self.rt.identities.learn(self.prefill, identity)
        if self.given is not None and identity != self.given:
            self.rt.metrics.identity_events.labels(self.prefill, "mismatched").inc()
            raise IdentityChanged(
                503, f"prefill {self.prefill} restarted (new engine id); retry", retry_after_s=1
            )
        return result.kv_transfer_params  # type: ignore[no-any-return]

    async def _watch(self) -> None:
        """Until the stream ends: P leg outcome and D's response headers, whichever first."""
        while not self.stream.ended:
            self._check_parallel_leg()  # P may have finished while the answer was written
            read = self.stream.next_message()
            waiting = {read} if self.given is None else {read, self.leg}
            done, _ = await asyncio.wait(
                waiting,
                timeout=self.rt.config.timeouts.request_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:
                return  # request_s elapsed: stop watching, Envoy's timeouts own it now
            if read.done():
                await self._on_message(self.stream.take())

    def _check_parallel_leg(self) -> None:
        """Once the parallel P leg is done: raise its failure or a restart, else learn."""
        if self.given is None or self.leg is None or not self.leg.done():
            return
        self._learn(self._leg_result())  # compares with the identity D was given
        self.given = None

    async def _on_message(self, message: Any) -> None:
        if message is None:
            if self.outcome == "cancelled" and self.leg is not None and not self.leg.done():
                log.info("request %s: stream ended before P answered", self.request_id)
            return
        if message.WhichOneof("request") != "response_headers":
            return
        status = int(envoy_msgs.header_map(message.response_headers).get(":status", "0"))
        self.outcome = "ok" if status < 400 else f"decode_{status // 100}xx"
        self.trace.decode_answered(status)
        if status >= 500 and self.prefill is not None:
            await self._on_decode_error()
        elif status >= 400:
            self._stop_parallel_leg()  # D's refusal is the answer; P's cannot change it
        elif not await self._settle_parallel_leg():
            return  # the stream ended while P computed
        await self.stream.write(envoy_msgs.continue_response_headers())

    async def _settle_parallel_leg(self) -> bool:
        """Hold D's response headers until the parallel P leg is settled; raise if it failed.

        Once they pass, the client has its 200 and a P failure can only cut the stream. A
        streaming D answers its headers at once, before P. The hold costs no time to first
        token: a push P answers when its prefill step ends and writes the KV only after that,
        and D's first token needs that KV plus a step of its own. False when the stream ended
        while waiting.
        """
        if self.given is None or self.leg is None:
            return True
        if not self.leg.done():
            wait_s = self.rt.config.timeouts.prefill_s  # the leg's own timeout ends it sooner
            await self.stream.write(envoy_msgs.extend_timeout(wait_s + 1))
            read = self.stream.next_message()
            await asyncio.wait(
                {self.leg, read}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not self.leg.done():
                if read.done():  # Envoy sends nothing while our answer is due: the end
                    self.stream.take()
                    return False
                self.leg.cancel()
                raise PrefillTimeout(
                    504, f"prefill endpoint {self.prefill} did not answer within {wait_s:g} s"
                )
        self._check_parallel_leg()  # raises P's failure or IdentityChanged
        return True

    def _stop_parallel_leg(self) -> None:
        self.given = None
        if self.leg is not None and not self.leg.done():
            self.leg.cancel()

    async def _on_decode_error(self) -> None:
        """D failed. If P restarted under this request, say so (retryable); else cancel P.

        A D given a stale identity fails its NIXL handshake at once, usually before P has
        answered; P's answer (with its new identity) tells the two cases apart, so it is
        awaited for a short grace.
        """
        assert self.prefill is not None
        grace = self.rt.config.timeouts.decode_error_grace_s
        if self.given is not None and self.leg is not None and not self.leg.done():
            await self.stream.write(envoy_msgs.extend_timeout(grace + 1))
            await asyncio.wait({self.leg}, timeout=grace)
        self._check_parallel_leg()  # raises IdentityChanged on a restart
        self.rt.identities.drop(self.prefill, only_if=self.given)
        self.given = None
        if self.leg is not None and not self.leg.done():
            self.leg.cancel()


def _refused_request(error: LegError) -> bool:
    """P answered 4xx: it refused this request (bad key, bad field), so P itself is fine."""
    return isinstance(error, PrefillFailed) and 400 <= error.status < 500


_PREFIX_BYTES = 4096  # enough of the prompt for prefix-affinity policies to hash


def _pick_request(request: ClientRequest, session: str | None) -> PickRequest:
    prompt = next((raw for key, raw in request.parts if key in ("prompt", "messages")), b"")
    return PickRequest(request.model, session, prompt[:_PREFIX_BYTES])
