""" "P/D that isn't P/D": notice when decode engines recompute prompts they should have received.

A decode engine started without `--kv-transfer-config`, with the other connector, or whose
transfers fail silently still answers every request, just slower; users only see TTFT creep
up. vLLM counts where each prompt token came from (`vllm:prompt_tokens_by_source_total`,
source = external_kv_transfer | local_compute | local_cache_hit); this module reads it from
every decode engine's page (fetched by the engine scraper), exports the share that arrived by
KV transfer, and warns when requests that this sidecar disaggregated were recomputed locally.

Requests sent decode-only on purpose (the decode-only decision, or `no_healthy_prefill:
decode_only`) are computed locally by design: their prompt tokens are counted apart and taken
off the window's local compute before the share is judged. The body's size in bytes bounds its
prompt tokens from above (a byte-level BPE token covers at least one byte, and the body also
holds the other fields), so deliberate decode-only traffic can never raise the alert; the
price is that a window made mostly of it can hide a broken decode engine until the next.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.config import KvCheckConfig
from extproc.engines.scraper import Families
from extproc.metrics import Metrics

__all__ = ["KvCheck", "prompt_tokens_by_source"]

log = logging.getLogger("extproc.engines.kv_check")

SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")
_FAMILY = "vllm:prompt_tokens_by_source"  # the parser drops the counter's _total suffix


def prompt_tokens_by_source(families: Families) -> dict[str, float] | None:
    """Totals per source, summed over the engine's other labels; None if not exported."""
    family = families.get(_FAMILY)
    totals: dict[str, float] = {}
    for sample in family.samples if family is not None else ():
        if sample.name.endswith("_total"):
            source = sample.labels.get("source", "")
            totals[source] = totals.get(source, 0.0) + sample.value
    return totals or None


@dataclass
class _Window:
    last: dict[str, float] | None = None
    share: float = math.nan
    alerts: int = 0
    totals: dict[str, float] = field(default_factory=dict)
    closed_at: float = -math.inf  # monotonic time the window last closed


class KvCheck:
    """A scraper consumer: one window per decode engine per `kv_check.interval_s`.

    The scraper may fetch a decode engine more often (its pool's policy reads engine load);
    the window still closes once per interval, so `min_share` keeps its meaning.
    """

    families = (_FAMILY,)

    def __init__(
        self,
        settings: Callable[[], KvCheckConfig],
        metrics: Metrics,
        is_decode: Callable[[str], bool],
    ) -> None:
        self._settings = settings  # re-read: a reload may change them
        self._metrics = metrics
        self._is_decode = is_decode
        self._windows: dict[str, _Window] = {}
        self._dispatched: Counter[str] = Counter()  # disaggregated requests per decode, per window
        self._alone: Counter[str] = Counter()  # decode-only body bytes per decode, per window

    def note_dispatch(self, decode: str) -> None:
        """A request was sent to `decode` with kv_transfer_params (called on the hot path)."""
        self._dispatched[decode] += 1

    def note_decode_only(self, decode: str, body_bytes: int) -> None:
        """A request was sent to `decode` to prefill itself (called on the hot path)."""
        self._alone[decode] += body_bytes

    def forget(self, address: str) -> None:
        """The decode endpoint left the pool."""
        self._windows.pop(address, None)
        self._dispatched.pop(address, None)
        self._alone.pop(address, None)

    def consume(self, address: str, families: Families) -> None:
        settings = self._settings()
        if not settings.enabled or not self._is_decode(address):
            return
        totals = prompt_tokens_by_source(families)
        window = self._windows.get(address)
        now = time.monotonic()
        # Half a tick of slack: the scraper's rounds do not land exactly on the interval.
        if totals is None or (window and now - window.closed_at < settings.interval_s * 0.75):
            return
        self._windows.setdefault(address, _Window()).closed_at = now
        self._update(address, totals)

    def _update(self, address: str, totals: dict[str, float]) -> None:
        window = self._windows.setdefault(address, _Window())
        previous, window.last, window.totals = window.last, totals, totals
        for source in SOURCES:
            self._metrics.decode_prompt_tokens.labels(address, source).set(totals.get(source, 0))
        dispatched = self._dispatched.pop(address, 0)
        alone = self._alone.pop(address, 0)  # an upper bound of decode-only prompt tokens
        if previous is None:
            return
        moved = totals.get("external_kv_transfer", 0) - previous.get("external_kv_transfer", 0)
        local = totals.get("local_compute", 0) - previous.get("local_compute", 0)
        local = max(0, local - alone)
        if moved + local <= 0:
            return
        window.share = moved / (moved + local)
        self._metrics.kv_transfer_share.labels(address).set(window.share)
        if dispatched and window.share < self._settings().min_share:
            window.alerts += 1
            self._metrics.recompute_alerts.labels(address).inc()
            log.warning(
                "decode %s computed %d of %d prompt tokens itself although %d requests were "
                "disaggregated: is it started with --kv-transfer-config and the same KV "
                "connector as the prefill engines (push/pull)?",
                address,
                local,
                moved + local,
                dispatched,
            )

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {
            address: {
                **{source: w.totals.get(source, 0) for source in SOURCES},
                "share": None if math.isnan(w.share) else round(w.share, 4),
                "alerts": w.alerts,
            }
            for address, w in self._windows.items()
        }
