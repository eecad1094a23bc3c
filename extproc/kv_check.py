""" "P/D that isn't P/D": notice when decode engines recompute prompts they should have received.

A decode engine started without `--kv-transfer-config`, with the other connector, or whose
transfers fail silently still answers every request, just slower; users only see TTFT creep
up. vLLM counts where each prompt token came from (`vllm:prompt_tokens_by_source_total`,
source = external_kv_transfer | local_compute | local_cache_hit); this module scrapes it from
every decode engine, exports the share that arrived by KV transfer, and warns when requests
that this sidecar disaggregated were recomputed locally.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.periodic import Periodic

if TYPE_CHECKING:
    from extproc.config import Config
    from extproc.metrics import Metrics

__all__ = ["KvCheck", "prompt_tokens_by_source"]

log = logging.getLogger("extproc.kv_check")

SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")
_FAMILY = "vllm:prompt_tokens_by_source"  # the parser drops the counter's _total suffix


def prompt_tokens_by_source(metrics_text: str) -> dict[str, float] | None:
    """Totals per source, summed over the engine's other labels; None if not exported."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != _FAMILY:
            continue
        for sample in family.samples:
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


class KvCheck:
    def __init__(
        self,
        decodes: Callable[[], list[str]],  # the decode pool's current members
        metrics: Metrics,
        config: Callable[[], Config],  # the current config: a reload swaps it
    ) -> None:
        self._decodes = decodes
        self._metrics = metrics
        self._config = config
        self._windows: dict[str, _Window] = {}
        self._dispatched: Counter[str] = Counter()  # disaggregated requests per decode, per window
        self._periodic: Periodic | None = None

    def note_dispatch(self, decode: str) -> None:
        """A request was sent to `decode` with kv_transfer_params (called on the hot path)."""
        self._dispatched[decode] += 1

    def start(self, session: aiohttp.ClientSession) -> None:
        """The loop runs even while disabled (its rounds then do nothing): a reload can switch
        `kv_check.enabled` either way."""
        self._periodic = Periodic(
            "kv-check", lambda: self.check_all(session),
            lambda: self._config().kv_check.interval_s,
        )  # fmt: skip
        self._periodic.start(first_now=True)  # the baseline the first window starts from

    async def stop(self) -> None:
        if self._periodic is not None:
            await self._periodic.stop()

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        if not self._config().kv_check.enabled:
            return
        await asyncio.gather(
            *(self._check(session, address) for address in self._decodes())
        )

    def forget(self, address: str) -> None:
        """The decode endpoint left the pool."""
        self._windows.pop(address, None)
        self._dispatched.pop(address, None)

    async def _check(self, session: aiohttp.ClientSession, address: str) -> None:
        try:
            async with session.get(
                f"http://{address}/metrics",
                timeout=aiohttp.ClientTimeout(total=self._config().health.timeout_s * 2),
            ) as response:
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return  # the health checker reports unreachable engines
        totals = prompt_tokens_by_source(text)
        if totals is not None:
            self._update(address, totals)

    def _update(self, address: str, totals: dict[str, float]) -> None:
        window = self._windows.setdefault(address, _Window())
        previous, window.last, window.totals = window.last, totals, totals
        for source in SOURCES:
            self._metrics.decode_prompt_tokens.labels(address, source).set(totals.get(source, 0))
        dispatched = self._dispatched.pop(address, 0)
        if previous is None:
            return
        moved = totals.get("external_kv_transfer", 0) - previous.get("external_kv_transfer", 0)
        local = totals.get("local_compute", 0) - previous.get("local_compute", 0)
        if moved + local <= 0:
            return
        window.share = moved / (moved + local)
        self._metrics.kv_transfer_share.labels(address).set(window.share)
        if dispatched and window.share < self._config().kv_check.min_share:
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
