"""Which prefill/decode pairs cannot exchange KV, learned by the probe's decode leg.

P says how it transfers (`transfer_mode` in its kv_transfer_params: push or pull); vLLM has no
endpoint that says how a decode engine's connector is set up. The probe finds out the way a
request would: it hands P's KV to a decode engine of the same model. A decode engine that
fails that exchange (a pull `NixlConnector` P with push `NixlPushConnector` decodes, or the
reverse) fails every disaggregated request, so the pair is recorded here: logged once as an
ERROR that says what to fix, listed on /ready, and named in the client's error instead of the
engine's bare 500. The next probe of the pair that succeeds clears it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["KvCompatibility", "Mismatch", "connector_of"]

log = logging.getLogger("extproc.engines.kv_compat")

_CONNECTORS = {"push": "NixlPushConnector", "pull": "NixlConnector"}


def connector_of(transfer_mode: str | None) -> str:
    """The vLLM connector a P's reported transfer mode stands for."""
    return _CONNECTORS.get(transfer_mode or "pull", "NixlConnector")


@dataclass(frozen=True, slots=True)
class Mismatch:
    prefill: str
    decode: str
    prefill_mode: str | None  # what P reported
    decode_answer: str  # what D answered the probe's KV: "HTTP 500: ..."

    @property
    def prefill_reports(self) -> str:
        return f"{connector_of(self.prefill_mode)} ({self.prefill_mode or 'pull'})"

    def log_line(self) -> str:
        return (
            f"prefill {self.prefill} and decode {self.decode} cannot exchange KV: P runs "
            f"{self.prefill_reports} and D failed the probe's transfer ({self.decode_answer}); "
            "start both with the same --kv-transfer-config kv_connector (NixlPushConnector "
            "for push, NixlConnector for pull)"
        )

    def client_message(self) -> str:
        """For the client: what is wrong, without the engines' addresses."""
        return (
            "the decode engine could not take the prefill engine's KV cache: their KV "
            f"connectors do not match (the prefill engine runs {self.prefill_reports}); "
            "the operator must start both with the same kv_connector"
        )

    def view(self) -> dict[str, object]:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "prefill_reports": self.prefill_reports,
            "decode_answer": self.decode_answer,
        }


class KvCompatibility:
    """The pairs the probe saw fail, keyed (prefill, decode)."""

    def __init__(self) -> None:
        self._failed: dict[tuple[str, str], Mismatch] = {}

    def failed(self, mismatch: Mismatch) -> bool:
        """Record the pair; whether it is news (logged once, not every probe round)."""
        key = (mismatch.prefill, mismatch.decode)
        news = self._failed.get(key) != mismatch
        if news:
            log.error("%s", mismatch.log_line())
        self._failed[key] = mismatch
        return news

    def passed(self, prefill: str, decode: str) -> None:
        if self._failed.pop((prefill, decode), None) is not None:
            log.warning("prefill %s and decode %s now exchange KV", prefill, decode)

    def between(self, prefill: str, decode: str) -> Mismatch | None:
        return self._failed.get((prefill, decode))

    def client_message(self, prefill: str, decode: str) -> str | None:
        mismatch = self._failed.get((prefill, decode))
        return None if mismatch is None else mismatch.client_message()

    def involving(self, endpoint: str) -> list[Mismatch]:
        return [m for m in self._failed.values() if endpoint in (m.prefill, m.decode)]

    def forget(self, endpoint: str) -> None:
        """The endpoint left its pool."""
        for key in [k for k in self._failed if endpoint in k]:
            del self._failed[key]

    def snapshot(self) -> list[dict[str, object]]:
        """For /ready."""
        return [m.view() for m in self._failed.values()]
