"""Per-request diagnostics: how each request was routed, what it met there, where its TTFT went.

`--per-request` writes one JSON object per request to DIR/<config>.requests.jsonl and the
requests at or past the run's p99 TTFT to DIR/<config>.tail.md: the conversation turn, the
chosen P and D, decode-only or not and the decision's reason, the prompt tokens the sidecar's
index said each held against what each engine found cached, the sidecar's own view of both
(in flight, pending and queued tokens) against what each engine really had in hand when the
leg reached its scheduler, and the TTFT's parts (simulated ms from the client's send).

What the sidecar saw is recorded by subclasses of its scheduler and decider that note the
pick's inputs and the decision, then do exactly what the product's do.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from extproc.config import Config, DecisionConfig
from extproc.policies.base import EndpointView, PickRequest
from extproc.scheduling.decision import Decider, Decision
from extproc.scheduling.scheduler import Picked, Scheduler
from lab.engines import Cluster, Served
from lab.outcome import Outcome

if TYPE_CHECKING:
    from extproc.scheduling.subset_hint import Subset

__all__ = ["RecordingDecider", "RecordingScheduler", "request_detail", "write_requests"]


class RecordingScheduler(Scheduler):
    """The product's scheduler, noting each pick's inputs (`seen`) before it picks."""

    seen: dict[str, Any] | None = None

    def pick(
        self,
        wanted: PickRequest,
        inflight: ExitStack,
        config: Config,
        subset: Subset | None = None,
        fallbacks: int = 1,
    ) -> Picked:
        for pool in (self.prefill, self.decode):
            for state in pool:
                state.refresh_peers()  # the sidecar's view: every process's counts
        views = {
            state.address: {
                "in_flight": state.in_flight + state.peer_in_flight,
                "pending_tokens": state.pending_tokens + state.peer_pending_tokens,
                "queued_tokens": state.queued_tokens + state.peer_queued_tokens,
                "foreign": state.foreign,
                "index_cached": (wanted.cached or {}).get(state.address, 0),
            }
            for pool in (self.prefill, self.decode)
            for state in pool
        }
        self.seen = {"prompt_tokens": wanted.prompt_tokens, "endpoints": views}
        return super().pick(wanted, inflight, config, subset, fallbacks)


class RecordingDecider(Decider):
    """The product's decider, keeping its last decision (`last`)."""

    last: Decision | None = None

    def decide(
        self,
        cfg: DecisionConfig,
        prompt_bytes: int | None,
        decode: str,
        d: EndpointView,
        p: EndpointView,
        prompt_tokens: int = 0,
        d_cached: int = 0,
        p_cached: int = 0,
    ) -> Decision:
        self.last = super().decide(
            cfg, prompt_bytes, decode, d, p, prompt_tokens, d_cached, p_cached
        )
        return self.last


def _ms(at: float | None, sent: float) -> float | None:
    return None if at is None else round((at - sent) * 1e3, 3)


def _leg(served: Served | None, sent: float) -> dict[str, Any] | None:
    if served is None:
        return None
    queue = served.queue_on_arrival
    return {
        "cached_tokens": served.cached_tokens,
        "computed_tokens": served.computed_tokens,
        "queue_on_arrival": None if queue is None else asdict(queue),
        "arrived_ms": _ms(served.arrived_at, sent),
        "submitted_ms": _ms(served.submitted_at, sent),
        "first_token_ms": _ms(served.first_token_at, sent),
    }


def request_detail(
    cluster: Cluster,
    seen: dict[str, Any] | None,
    decision: Decision | None,
    legs: tuple[Served | None, Served],
    addresses: tuple[str | None, str],
    sent: float,
    released: float,
) -> dict[str, Any]:
    """One request's diagnostics (times in simulated ms from the client's send)."""
    p_served, d_served = legs
    prefill, decode = addresses
    views = (seen or {}).get("endpoints", {})
    names = cluster.by_address
    return {
        "prompt_tokens": (seen or {}).get("prompt_tokens"),
        "prefill": None if prefill is None else names[prefill].name,
        "decode": names[decode].name,
        "decision": None
        if decision is None
        else {
            "decode_only": decision.decode_only,
            "reason": decision.reason,
            "alone_ms": round(decision.ttft_alone_ms, 3),
            "pd_ms": round(decision.ttft_pd_ms, 3),
        },
        "sidecar_view": {
            "prefill": None if prefill is None else views.get(prefill),
            "decode": views.get(decode),
        },
        "p_leg": _leg(p_served, sent),
        "d_leg": _leg(d_served, sent),
        "d_headers_released_ms": _ms(released, sent),
        "sent_ms": round(sent * 1e3, 3),  # simulated, from the run's start
    }


def _row(outcome: Outcome) -> dict[str, Any]:
    return {
        "ok": outcome.ok,
        "ttft_ms": None if outcome.ttft_s is None else round(outcome.ttft_s * 1e3, 3),
        "tpot_ms": None if outcome.tpot_s is None else round(outcome.tpot_s * 1e3, 3),
        "strategy": outcome.strategy,
        **(outcome.detail or {}),
    }


def _tail_line(row: dict[str, Any]) -> str:
    p, d = row.get("p_leg") or {}, row.get("d_leg") or {}
    view = row.get("sidecar_view") or {}
    pv, dv = view.get("prefill") or {}, view.get("decode") or {}
    pq, dq = p.get("queue_on_arrival") or {}, d.get("queue_on_arrival") or {}
    decision = row.get("decision") or {}
    cells = [
        row.get("chain"),
        row.get("turn"),
        row["ttft_ms"],
        row.get("prompt_tokens"),
        row["strategy"],
        decision.get("reason", "—"),
        row.get("prefill") or "—",
        f"{pv.get('index_cached', '—')}/{p.get('cached_tokens', '—')}",
        f"{pv.get('pending_tokens', '—')}/{pq.get('prefill_tokens', '—')}",
        f"{pq.get('waiting', '—')}/{pq.get('running', '—')}",
        p.get("first_token_ms", "—"),
        row.get("decode"),
        f"{dv.get('index_cached', '—')}/{d.get('cached_tokens', '—')}",
        f"{dv.get('pending_tokens', '—')}/{dq.get('prefill_tokens', '—')}",
        f"{dq.get('waiting', '—')}/{dq.get('remote_wait', '—')}/{dq.get('running', '—')}",
        d.get("submitted_ms", "—"),
        d.get("first_token_ms", "—"),
    ]
    return "| " + " | ".join("—" if c is None else str(c) for c in cells) + " |"


_TAIL_HEAD = (
    "| chain | turn | TTFT | prompt | strategy | decision | P | P cached: index/engine "
    "| P pending: sidecar/engine | P waiting/running | P done | D | D cached: index/engine "
    "| D pending: sidecar/engine | D waiting/remote/running | D submitted | D first token |\n"
    + "|---" * 17
    + "|\n"
)


def write_requests(folder: Path, name: str, outcomes: list[Outcome], p99_ms: float | None) -> None:
    """DIR/<name>.requests.jsonl (every request) and DIR/<name>.tail.md (TTFT ≥ p99)."""
    rows = [_row(o) for o in outcomes]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.requests.jsonl").write_text(
        "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    )
    tail = sorted(
        (
            r
            for r in rows
            if r["ttft_ms"] is not None and p99_ms is not None and r["ttft_ms"] >= p99_ms
        ),
        key=lambda r: -r["ttft_ms"],
    )
    (folder / f"{name}.tail.md").write_text(
        f"# {name}: the requests at or past TTFT p99 ({p99_ms} ms)\n\n"
        "Times in simulated ms from the client's send; pending: prompt tokens still to "
        "compute, as the sidecar counted them at the pick and as the engine had them when "
        "the leg reached its scheduler.\n\n" + _TAIL_HEAD + "\n".join(map(_tail_line, tail)) + "\n"
    )
