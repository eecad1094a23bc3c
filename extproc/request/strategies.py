"""The three ways a dispatch plan is run: one class per strategy.

Each runs its plan's legs and answers for them until the stream ends:

  send(started)             P leg (when the strategy has one) and Envoy's body answer for D;
                            False when the client went away first
  watch()                   the P leg still to wait for beside Envoy's next message, or None;
                            raises P's failure or a restart once it is known
  on_decode_headers(status, reached)
                            before D's response headers pass (`reached` False: Envoy's own
                            reply, D never got the request): True to let them pass, False
                            when the stream ended meanwhile; raises to end the request instead
  close(client_gone)        cancel a P leg still running (its work is useless now)

Parallel: P leaves before D's body answer is written, and D's successful response headers are
held until P settles, so a P failure or a restart always reaches the client as a clean status
(503 + Retry-After for a restart), never as a 200 that is then cut. This holds also when D
could recompute the prompt itself (`kv_load_failure_policy: recompute`): the ext_proc sees
neither D's policy nor its body, so it cannot tell a complete answer from an in-stream error,
and a retry gets real P/D instead of a decode engine prefilling on its own.
Serial: P is awaited (a buffered body's Envoy timer extended first), its params go into D's
body. A P that cannot be reached or answers 503 is retried once on the plan's fallback
prefill, within the same `timeouts.prefill_s` (nothing has left for D yet, so the retry is
safe). Parallel dispatch cannot retry: D was already sent with the first P's identity.
Decode-only: D's body is the client's; nothing to watch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from extproc.errors import (
    IdentityChanged,
    KvLost,
    LegError,
    PrefillBusy,
    PrefillFailed,
    PrefillTimeout,
    PrefillUnreachable,
)
from extproc.headers import RANK_HEADER
from extproc.protocol.bodies import Spliced, decode_body
from extproc.protocol.identity import PrefillIdentity, identity_from_params, where
from extproc.request import envoy_msgs
from extproc.request.body_turns import BodyTurns
from extproc.request.plan import DecodeOnlyPlan, ParallelPlan, Plan, SerialPlan, check_fits
from extproc.request.prefill_client import PrefillCall
from extproc.request.pushed_kv import Owed, PushedKv

if TYPE_CHECKING:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.config import Config
    from extproc.metrics import Metrics
    from extproc.request.prefill_client import PrefillResult, PrefillSender
    from extproc.request.stream import EnvoyStream
    from extproc.tracing import RequestTrace

__all__ = [
    "NOT_DISPATCHED",
    "Dispatch",
    "Exchange",
    "LegServices",
    "decode_answers",
    "start_dispatch",
]

log = logging.getLogger("extproc.request.parse")


class InFlight(Protocol):
    """The request's in-flight count at its prefill (`extproc.scheduling.pool.Counted`): a P leg
    holds it while it runs only, so that picking and admission see P's real load."""

    rank: int | None  # the data-parallel rank chosen at its endpoint (None: it has none)

    def move_to(self, address: str, same_rank: bool = True) -> None: ...
    def release(self) -> None: ...


class _NotCounted:
    rank: int | None = None

    def move_to(self, address: str, same_rank: bool = True) -> None:
        pass

    def release(self) -> None:
        pass


_NOT_COUNTED = _NotCounted()


class Identities(Protocol):
    """What dispatch needs of the identity cache."""

    def get(self, endpoint: str, rank: int | None = None) -> PrefillIdentity | None: ...
    def serial_only(self, endpoint: str, rank: int | None = None) -> bool: ...
    def learn(self, endpoint: str, identity: PrefillIdentity, rank: int | None = None) -> None: ...
    def drop(
        self, endpoint: str, only_if: PrefillIdentity | None = None, rank: int | None = None
    ) -> bool: ...


@dataclass(frozen=True, slots=True)
class LegServices:
    """The process-wide parts the legs use; built once by the wiring."""

    prefill_client: PrefillSender
    identities: Identities
    mark_unreachable: Callable[[str], None]  # a prefill endpoint Envoy could not reach
    note_dispatch: Callable[[str], None]  # a disaggregated request went to this decode
    metrics: Metrics
    # a decode-only request went to this decode, with a body of this many bytes
    note_decode_only: Callable[[str, int], None] = lambda decode, body_bytes: None
    # the pushes P still owes the streams whose headers passed (`extproc.request.pushed_kv`)
    pushed_kv: PushedKv = field(default_factory=PushedKv)
    # big bodies' steps on the loop, one at a time (`extproc.request.body_turns`)
    turns: BodyTurns = field(default_factory=BodyTurns)


@dataclass(slots=True)  # not frozen: built per request, and a frozen init costs ~4x
class Exchange:
    """The request's side of the stream: where answers go and what the P leg carries."""

    stream: EnvoyStream
    trace: RequestTrace
    path: str  # the API path, the same for P
    forwarded: dict[str, str]  # client headers the P leg carries too
    client_request_id: str
    config: Config  # the request's snapshot, taken when its stream opened
    streamed: bool = False  # the body streamed in (FULL_DUPLEX_STREAMED), else buffered
    # endpoint picker: the destination goes out as dynamic metadata in this namespace too
    destination_namespace: str | None = None
    # forwarded headers the client repeated: D gets each once, with P's value
    single_headers: dict[str, str] | None = None
    stream_answer: bool = False  # the client asked for a streamed answer (`stream: true`)


def decode_answers(
    plan: Plan, body: Spliced, exchange: Exchange
) -> Iterator[ep.ProcessingResponse]:
    """Envoy's answers that send `body` to D: the one place that says where D is.

    Buffered: one body answer carrying the headers. Streamed: the headers' answer, then the
    new body in chunks, each built as the one before has been written.
    """
    kept = exchange.config.dispatch.client_engine_priority
    single = exchange.single_headers
    rank = plan.decode_rank
    if exchange.streamed:
        mutation = envoy_msgs.route_mutation(
            plan.decodes, plan.request_id, len(body), rank, single, kept
        )
        first = envoy_msgs.headers_answer(mutation)
    else:
        first = envoy_msgs.body_answer(body, plan.decodes, plan.request_id, rank, single, kept)
    if exchange.destination_namespace is not None:  # the answer that sets the header
        envoy_msgs.with_destination_metadata(first, plan.decodes, exchange.destination_namespace)
    yield first
    if exchange.streamed:
        yield from envoy_msgs.streamed_body_answers(body)


class Dispatch(Protocol):
    async def send(self, started: float) -> bool: ...
    def watch(self) -> asyncio.Future[Any] | None: ...
    async def on_decode_headers(self, status: int, reached: bool) -> bool: ...
    def close(self, client_gone: bool) -> None: ...


class DecodeOnlyDispatch:
    """No P leg: `send` writes D's body (`answer`, the client's own), then there is nothing to
    watch, hold or cancel. Without an answer it is NOT_DISPATCHED, the runner of a request with
    no plan yet (refused or unfinished)."""

    def __init__(self, answer: Callable[[float], Awaitable[None]] | None = None) -> None:
        self._answer = answer

    async def send(self, started: float) -> bool:
        if self._answer is not None:
            await self._answer(started)
        return True

    def watch(self) -> None:
        return None

    async def on_decode_headers(self, status: int, reached: bool) -> bool:
        return True

    def close(self, client_gone: bool) -> None:
        pass


NOT_DISPATCHED = DecodeOnlyDispatch()


def start_dispatch(
    plan: Plan, services: LegServices, exchange: Exchange, counted: InFlight | None = None
) -> Dispatch:
    """The runner of `plan`. A parallel plan's P leg leaves here, before D's answer is written.
    `counted`: the request's in-flight count at `plan.prefill`, which its P legs release."""
    counted = _NOT_COUNTED if counted is None else counted
    match plan:
        case ParallelPlan():
            return ParallelDispatch(plan, services, exchange, counted)
        case SerialPlan():
            return SerialDispatch(plan, services, exchange, counted)
        case DecodeOnlyPlan():
            d_body = plan.d_body
            return DecodeOnlyDispatch(
                lambda started: _answer(plan, d_body, started, services, exchange)
            )


class _PrefillLeg:
    """One P request in flight, owned by the strategy that started it; `counted` (the
    request's count at `prefill`) is released as soon as the leg ends, however it ends.
    `rank`: P's data-parallel rank, sent in vLLM's header; what is learnt or dropped is that
    rank's identity."""

    def __init__(
        self,
        prefill: str,
        body: Spliced,
        request_id: str,
        services: LegServices,
        exchange: Exchange,
        counted: InFlight,
        timeout_s: float | None = None,
        rank: int | None = None,
    ) -> None:
        self.prefill = prefill
        self.rank = rank
        self._services = services
        self._trace = exchange.trace
        self._counted = counted
        self.started = time.perf_counter()
        self.identity: PrefillIdentity | None = None  # P's, once its answer is checked
        exchange.trace.prefill_started()
        config = exchange.config
        timeout_s = config.timeouts.prefill_s if timeout_s is None else timeout_s
        headers = exchange.forwarded
        if rank is not None:
            headers = headers | {RANK_HEADER: str(rank)}
        call = PrefillCall(prefill, exchange.path, body, request_id, timeout_s, config, headers)
        self.task: asyncio.Task[PrefillResult] = asyncio.create_task(self._sent(call))

    async def _sent(self, call: PrefillCall) -> PrefillResult:
        try:
            return await self._services.prefill_client.send(call)
        finally:
            self._counted.release()  # P's answer is complete (or the leg failed)

    def record_outcome(self) -> PrefillResult:
        """Record how the finished leg ended (metrics, trace; on failure the identity dropped
        and an unreachable endpoint marked down), then return its result or raise."""
        services = self._services
        metrics = services.metrics
        try:
            result = self.task.result()
        except LegError as error:
            self._trace.prefill_finished(error.label)
            metrics.series(metrics.prefill_seconds, error.label).observe(
                time.perf_counter() - self.started
            )
            if not _refused_request(error):
                services.identities.drop(self.prefill, rank=self.rank)
            if isinstance(error, PrefillUnreachable):
                services.mark_unreachable(self.prefill)
            raise
        metrics.series(metrics.prefill_seconds, "ok").observe(result.elapsed_s)
        self._trace.prefill_finished("ok")
        return result

    def learn(self, result: PrefillResult, given: PrefillIdentity | None) -> dict[str, Any]:
        """Validate P's params (never forward unchecked values) and refresh the cache;
        IdentityChanged if P is not the engine D was `given`."""
        identities = self._services.identities
        try:
            identity = identity_from_params(result.kv_transfer_params)
        except ValueError as error:
            identities.drop(self.prefill, rank=self.rank)
            raise PrefillFailed(
                502,
                "the prefill engine sent unusable kv_transfer_params",
                detail=f"prefill {self.prefill}: {error}",
            ) from None
        identities.learn(self.prefill, identity, self.rank)
        self.identity = identity
        if given is not None and identity != given:
            engine = where(self.prefill, self.rank)
            self._services.metrics.identity_events.labels(engine, "mismatched").inc()
            raise IdentityChanged(
                503,
                "the prefill engine restarted (new engine id); retry",
                retry_after_s=1,
                detail=f"prefill {engine}",
            )
        return result.kv_transfer_params  # type: ignore[no-any-return]

    def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()
            self._counted.release()  # a task cancelled before it ran never reaches its finally
        elif not self.task.cancelled():
            self.task.exception()  # D answered first (its own error): P's is moot


def _refused_request(error: LegError) -> bool:
    """P answered 4xx: it refused this request (bad key, bad field), so P itself is fine."""
    return isinstance(error, PrefillFailed) and 400 <= error.status < 500


async def _answer(
    plan: Plan, body: Spliced, started: float, services: LegServices, exchange: Exchange
) -> None:
    """The body answer every strategy ends its `send` with: D's body goes out (a big one in
    its turn: copying it into the answer and into gRPC's buffers is one long step)."""
    async with services.turns.turn(len(body)):
        for answer in decode_answers(plan, body, exchange):
            await exchange.stream.write(answer)
    exchange.trace.decode_started()
    if plan.prefill is not None:
        services.note_dispatch(plan.decodes[0])
    else:
        services.note_decode_only(plan.decodes[0], len(body))
    services.metrics.processing_seconds.observe(time.perf_counter() - started)
    log.debug(
        "request %s (client id %r): %s/%s P=%s D=%s",
        plan.request_id,
        exchange.client_request_id,
        plan.strategy,
        plan.reason,
        plan.prefill,
        plan.decodes[0],
    )


class _OwedPush:
    """The push P still owes a stream whose 2xx headers passed, watched until the stream ends:
    `watch` raises KvLost once the engine that owes it is known to be gone before it could
    write it (`extproc.request.pushed_kv`)."""

    def __init__(self, services: LegServices, exchange: Exchange) -> None:
        self._pushed = services.pushed_kv
        self._exchange = exchange
        self._owed: Owed | None = None

    def start(self, prefill: str, identity: PrefillIdentity) -> None:
        """D's headers passed; `identity` is the P that answered. A whole answer is sent once
        D is done (its KV was there long before); only a streamed one can wait in silence."""
        if self._exchange.stream_answer:
            config = self._exchange.config
            landing_s = config.timeouts.pushed_kv_s
            # a P lost meanwhile is seen by then: a failed health check, or its new engine id
            # once the probe that follows a restart has learned it
            keep_s = landing_s + 2 * (config.health.interval_s + config.health.timeout_s)
            self._owed = self._pushed.owe(prefill, identity.engine_id, landing_s, keep_s)

    def watch(self) -> asyncio.Future[None] | None:
        owed = self._owed
        if owed is None:
            return None
        if owed.lost.done():
            self.stop()
            raise KvLost(
                503,
                "the prefill engine restarted or stopped before its KV reached the decode"
                " engine; retry",
                retry_after_s=1,
                detail=f"prefill {owed.endpoint}, engine {owed.engine_id}",
            )
        return owed.lost

    def stop(self) -> None:
        if self._owed is not None:
            self._pushed.release(self._owed)
            self._owed = None


class SerialDispatch:
    def __init__(
        self, plan: SerialPlan, services: LegServices, exchange: Exchange, counted: InFlight
    ) -> None:
        self._plan = plan
        self._services = services
        self._exchange = exchange
        self._counted = counted
        self._prefill = plan.prefill  # the P that answered (the fallback after a retry)
        self._rank = plan.prefill_rank  # its rank (a fallback's is chosen when it is counted)
        self._identity: PrefillIdentity | None = None  # the P that answered, once checked
        self._owed = _OwedPush(services, exchange)

    async def send(self, started: float) -> bool:
        plan, exchange = self._plan, self._exchange
        prefill_s = exchange.config.timeouts.prefill_s
        if not exchange.streamed:  # a streamed body's answer has no Envoy timer
            await exchange.stream.write(envoy_msgs.extend_timeout(prefill_s + 1))
        waited = time.perf_counter()
        kv_params = await self._prefilled(waited + prefill_s)
        if kv_params is None:
            return False
        started += time.perf_counter() - waited
        d_body = decode_body(plan.parts, kv_params)
        check_fits(exchange.config.limits.max_body_bytes, d_body)  # P's params known now
        await _answer(plan, d_body, started, self._services, exchange)
        return True

    async def _prefilled(self, deadline: float) -> dict[str, Any] | None:
        """P's checked params, after one retry on the fallback P if the first could not be
        reached or answered 503 and time is left; None when the stream ended first."""
        plan, services, stream = self._plan, self._services, self._exchange.stream
        fallback, timeout_s = plan.fallback, None
        while True:
            # a retry is counted at its fallback, at a rank chosen there: its leg is to leave
            self._counted.move_to(self._prefill, same_rank=False)
            if self._prefill != plan.prefill:
                self._rank = self._counted.rank
            leg = _PrefillLeg(
                self._prefill,
                plan.p_body,
                plan.request_id,
                services,
                self._exchange,
                self._counted,
                timeout_s,
                self._rank,
            )
            try:
                read = stream.next_message()
                await asyncio.wait({leg.task, read}, return_when=asyncio.FIRST_COMPLETED)
                if not leg.task.done():
                    # Envoy sends nothing while it waits for our body answer: the stream's end.
                    stream.take()
                    return None
                try:
                    params = leg.learn(leg.record_outcome(), given=None)
                    self._identity = leg.identity
                    return params
                except (PrefillUnreachable, PrefillBusy) as error:
                    timeout_s = deadline - time.perf_counter()
                    if fallback is None or timeout_s <= 0:
                        raise
                    reason = "busy" if isinstance(error, PrefillBusy) else "unreachable"
                    services.metrics.prefill_retries.labels(reason).inc()
                    log.info(
                        "request %s: prefill %s %s, retrying on %s",
                        plan.request_id,
                        self._prefill,
                        reason,
                        fallback,
                    )
                    self._prefill, fallback = fallback, None
            finally:
                leg.cancel()  # the client went away while P computed (or this task was cancelled)

    def watch(self) -> asyncio.Future[None] | None:
        return self._owed.watch()  # P settled before D's body left; its push may not have

    async def on_decode_headers(self, status: int, reached: bool) -> bool:
        if status >= 500 and reached:
            self._services.identities.drop(self._prefill, rank=self._rank)  # D failed: learn again
        identity = self._identity
        if status < 400 and identity is not None and identity.transfer_mode == "push":
            self._owed.start(
                where(self._prefill, self._rank), identity
            )  # pull: D reads, and fails if P is gone
        return True

    def close(self, client_gone: bool) -> None:
        self._owed.stop()  # `send` settled or cancelled its leg


class ParallelDispatch:
    """P leaves, then D's answer one event-loop turn later; D carries P's cached identity
    (`plan.given`)."""

    def __init__(
        self, plan: ParallelPlan, services: LegServices, exchange: Exchange, counted: InFlight
    ) -> None:
        self._plan = plan
        self._services = services
        self._exchange = exchange
        # Created before the answer is written; `send` lets it write its request first.
        self._leg = _PrefillLeg(
            plan.prefill,
            plan.p_body,
            plan.request_id,
            services,
            exchange,
            counted,
            rank=plan.prefill_rank,
        )
        self._settled = False  # P's outcome is known (or no longer matters)
        self._owed = _OwedPush(services, exchange)

    async def send(self, started: float) -> bool:
        # One loop turn for the P leg's task, whose request then leaves on a kept-alive
        # connection at once: P starts computing before Envoy has D's body.
        await asyncio.sleep(0)
        await _answer(self._plan, self._plan.d_body, started, self._services, self._exchange)
        self._services.metrics.skew_seconds.observe(abs(time.perf_counter() - self._leg.started))
        return True

    def watch(self) -> asyncio.Future[Any] | None:
        if self._settled:
            return self._owed.watch()
        if self._leg.task.done():  # P may have finished while the answer was written
            self._settle()
            return None
        return self._leg.task

    def _settle(self) -> None:
        """P is done: raise its failure or a restart (a new engine id), else learn."""
        self._settled = True
        self._leg.learn(self._leg.record_outcome(), self._plan.given)

    async def on_decode_headers(self, status: int, reached: bool) -> bool:
        if not reached:  # D never got the request, so it says nothing about P's identity
            self._stop()
            return True
        if status >= 500:
            await self._on_decode_error()
            return True
        if status >= 400:
            self._stop()  # D's refusal is the answer; P's cannot change it
            return True
        if not await self._hold_until_settled():
            return False
        self._owed.start(
            where(self._plan.prefill, self._plan.prefill_rank), self._plan.given
        )  # P answered as `given`
        return True

    async def _hold_until_settled(self) -> bool:
        """Hold D's response headers until P is settled; raise if it failed.

        Once they pass, the client has its 200 and a P failure can only cut the stream. A
        streaming D answers its headers at once, before P. The hold costs no time to first
        token: a push P answers when its prefill step ends and writes the KV only after that,
        and D's first token needs that KV plus a step of its own. False when the stream ended
        while waiting.
        """
        if self._settled:
            return True
        task, stream = self._leg.task, self._exchange.stream
        if not task.done():
            wait_s = self._exchange.config.timeouts.prefill_s  # the leg's own timeout is sooner
            await stream.write(envoy_msgs.extend_timeout(wait_s + 1))
            read = stream.next_message()
            await asyncio.wait({task, read}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and read.done():
                early = stream.take()
                if early is None:  # the stream ended
                    return False
                # D's body streaming through the ext_proc (a gateway's FULL_DUPLEX_STREAMED
                # response): answered after the headers; only P is awaited meanwhile.
                stream.put_back(early)
                await asyncio.wait({task}, timeout=wait_s)
            if not task.done():
                self._stop()
                raise PrefillTimeout(
                    504,
                    f"the prefill engine did not answer within {wait_s:g} s",
                    detail=f"prefill {self._plan.prefill}",
                )
        self._settle()
        return True

    async def _on_decode_error(self) -> None:
        """D failed. If P restarted under this request, say so (retryable); else cancel P.

        A D given a stale identity fails its NIXL handshake at once, usually before P has
        answered; P's answer (with its new identity) tells the two cases apart, so it is
        awaited for a short grace.
        """
        task = self._leg.task
        if not self._settled and not task.done():
            grace = self._exchange.config.timeouts.decode_error_grace_s
            await self._exchange.stream.write(envoy_msgs.extend_timeout(grace + 1))
            await asyncio.wait({task}, timeout=grace)
        self.watch()  # raises a restart P revealed meanwhile
        # D failed with `given`: an identity learnt since (P's next engine) is not suspect
        plan = self._plan
        self._services.identities.drop(plan.prefill, plan.given, plan.prefill_rank)
        self._stop()

    def _stop(self) -> None:
        self._settled = True
        if not self._leg.task.done():
            self._leg.cancel()

    def close(self, client_gone: bool) -> None:
        if client_gone and not self._leg.task.done():
            log.info("request %s: stream ended before P answered", self._plan.request_id)
        self._leg.cancel()
        self._owed.stop()
