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
Decode-only: D prefills the prompt itself, either by decision (`extproc.scheduling.decision`: the
reason says why) or because no P is healthy and `no_healthy_prefill: decode_only`
(reason `no_prefill`).

`plan_dispatch` turns a request and what was picked into one of three plans, without I/O;
`extproc.request.strategies` has the class that runs each.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from extproc.config import DispatchMode
from extproc.errors import ClientError
from extproc.protocol.bodies import buffer_bytes, decode_body, prefill_body, prefill_kv_params
from extproc.protocol.identity import PrefillIdentity
from extproc.request.parse import ClientRequest

__all__ = [
    "DecodeOnlyPlan",
    "ParallelPlan",
    "Plan",
    "SerialPlan",
    "Strategy",
    "check_fits",
    "check_plan_fits",
    "choose_strategy",
    "plan_dispatch",
]


class Strategy(StrEnum):
    PARALLEL = "parallel"
    SERIAL = "serial"
    DECODE_ONLY = "decode_only"  # by decision, or no healthy P (`no_healthy_prefill`)


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


@dataclass(frozen=True, slots=True)
class DecodeOnlyPlan:
    request_id: str
    decodes: list[str]  # the choice, then Envoy's connect-failure fallbacks
    d_body: bytes
    reason: str = "no_prefill"
    prefill = None
    strategy = Strategy.DECODE_ONLY


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    request_id: str
    decodes: list[str]
    prefill: str
    p_body: bytes
    d_body: bytes  # carries `given`, P's cached identity
    given: PrefillIdentity
    reason: str
    strategy = Strategy.PARALLEL


@dataclass(frozen=True, slots=True)
class SerialPlan:
    request_id: str
    decodes: list[str]
    prefill: str
    p_body: bytes  # D's body is built from P's answer
    parts: list[tuple[str, bytes]]  # the client body's members, for D's body
    reason: str
    fallback: str | None = None  # another P for one retry if `prefill` fails to answer
    strategy = Strategy.SERIAL


Plan = DecodeOnlyPlan | ParallelPlan | SerialPlan


def plan_dispatch(
    request: ClientRequest,
    request_id: str,
    decodes: list[str],
    prefill: str | None,
    choice: tuple[Strategy, str],
    identity: PrefillIdentity | None,
    fallback: str | None = None,
) -> Plan:
    """The legs' bodies and destinations. `choice` is `choose_strategy`'s answer for
    `prefill`, or (DECODE_ONLY, reason) without one. `fallback`: a second P a serial plan
    may retry on. `check_plan_fits` checks the bodies' sizes."""
    strategy, reason = choice
    if prefill is None:
        return DecodeOnlyPlan(request_id, decodes, decode_body(request.parts, None), reason)
    transfer_id = f"xfer-{request_id}"  # unique per request, one uuid4 fewer
    p_body = prefill_body(
        request.parts, request.has_max_completion_tokens, prefill_kv_params(transfer_id)
    )
    if strategy is Strategy.PARALLEL and identity is not None:
        d_body = decode_body(request.parts, identity.decode_params(request_id, transfer_id))
        return ParallelPlan(request_id, decodes, prefill, p_body, d_body, identity, reason)
    return SerialPlan(request_id, decodes, prefill, p_body, request.parts, reason, fallback)


def check_plan_fits(plan: Plan, max_body_bytes: int) -> None:
    """ClientError (413) if a body the plan sends would not fit Envoy's buffer; called before
    any leg leaves. A decode-only body is the client's own, minus fields: it always fits."""
    match plan:
        case ParallelPlan():
            check_fits(max_body_bytes, plan.p_body, plan.d_body)
        case SerialPlan():
            check_fits(max_body_bytes, plan.p_body)  # D's body is checked once P answered
        case DecodeOnlyPlan():
            pass


def check_fits(max_body_bytes: int, *bodies: bytes) -> None:
    """A body longer than Envoy's buffer would be refused there: refuse it before it leaves.

    Envoy's buffer leaves room for the splice (`buffer_bytes`), so only a serial D body
    with an unusually long list of P's KV blocks can get here.
    """
    limit = buffer_bytes(max_body_bytes)
    size = max(len(body) for body in bodies)
    if size > limit:
        raise ClientError(
            413,
            f"with its kv_transfer_params the body for an engine is {size} bytes, "
            f"over the proxy's buffer of {limit} bytes; send a shorter prompt",
        )
