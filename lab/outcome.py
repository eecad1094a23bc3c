"""What one client request came to in the lab: as the client saw it, and how it was routed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Outcome"]


@dataclass
class Outcome:
    """One client request, as the client saw it, and how the sidecar routed it."""

    ok: bool
    status: int = 200
    error: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    strategy: str = ""
    prefill: str | None = None
    decode: str | None = None
    finished_at: float = 0.0
    detail: dict[str, Any] | None = None  # the per-request diagnostics (`lab.diagnostics`)
