"""The start-up health summary: one log block, one line per engine, once the first health
round and the identity probes are done.

Each line says whether the engine answered (and why not), its role, the connector (for a
prefill engine: what it reports in kv_transfer_params; for a decode engine: vLLM does not say,
so what the probe's exchange showed), and the mode the sidecar dispatches it in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from extproc.engines.kv_compat import KvCompatibility, connector_of
from extproc.protocol.identity import PrefillIdentity
from extproc.scheduling.pool import EndpointState

__all__ = ["startup_summary", "summary_is_clean"]


def _reachable(state: EndpointState, reasons: Mapping[str, str]) -> str:
    return "reachable" if state.healthy else f"NOT reachable ({reasons.get(state.address, '?')})"


def _prefill_line(
    state: EndpointState,
    reasons: Mapping[str, str],
    identity: PrefillIdentity | None,
    mode: str,
    compat: KvCompatibility,
) -> str:
    if identity is None:
        connector = "connector unknown (no identity learned yet)"
    else:
        connector = f"{connector_of(identity.transfer_mode)} ({identity.transfer_mode or 'pull'})"
    line = f"  prefill {state.address}: {_reachable(state, reasons)}, {connector}, mode {mode}"
    pulls = identity is not None and identity.transfer_mode == "pull"
    if pulls and mode in ("push", "serial_push"):
        line += " (MISMATCH: P transfers by pull; set dispatch.mode: auto or pull)"
    bad = compat.involving(state.address)
    return line + (
        f", cannot exchange KV with decode {', '.join(m.decode for m in bad)}" if bad else ""
    )


def _decode_line(state: EndpointState, reasons: Mapping[str, str], compat: KvCompatibility) -> str:
    bad = compat.involving(state.address)
    connector = (
        f"KV exchange FAILED with prefill {', '.join(m.prefill for m in bad)}"
        if bad
        else "connector not reported by vLLM (a KV exchange shows a mismatch)"
    )
    return f"  decode {state.address}: {_reachable(state, reasons)}, {connector}"


def startup_summary(
    prefill: Iterable[EndpointState],
    decode: Iterable[EndpointState],
    reasons: Mapping[str, str],
    identity_of: Callable[[str], PrefillIdentity | None],
    mode_of: Callable[[str], str],
    compat: KvCompatibility,
) -> str:
    lines = ["engines at start-up:"]
    lines += [
        _prefill_line(s, reasons, identity_of(s.address), mode_of(s.address), compat)
        for s in prefill
    ]
    lines += [_decode_line(s, reasons, compat) for s in decode]
    return "\n".join(lines)


def summary_is_clean(text: str) -> bool:
    """Every engine answered and nothing is mismatched (the block is then only INFO)."""
    return "NOT reachable" not in text and "MISMATCH" not in text and "FAILED" not in text
