"""One engine scraper: each engine's /metrics fetched once per interval, parsed once.

The families (prometheus_client's parser) go to every consumer: restart detection
(`process_start_time_seconds`), engine load (`extproc.engines.load`) and prompt-source counts
(`extproc.engines.kv_check`). Which engines are scraped, and how often, is re-read every round from
`plan` (address → interval), so discovery and reloads need nothing from the scraper. The
health checker also scrapes prefill engines through `scrape` (their health is "/metrics
answers 200"); an engine scraped that way is not scraped again before its interval is up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from extproc.engines.health_reasons import failure_reason
from extproc.periodic import Periodic

__all__ = ["EngineScraper", "Families", "MetricsConsumer", "parse_families"]

log = logging.getLogger("extproc.engines.scraper")

Families = Mapping[str, Metric]  # family name (a counter's without _total) → its samples


class MetricsConsumer(Protocol):
    @property
    def families(self) -> Collection[str]: ...  # the family names it reads

    def consume(self, address: str, families: Families) -> None: ...


def parse_families(text: str, only: tuple[str, ...] | None = None) -> dict[str, Metric]:
    """The metric families of a Prometheus text page; {} if it does not parse.

    `only`: parse just the families whose names start with one of these. A vLLM page is
    ~100 kB of histograms; parsing all of it takes ~20 ms of the event loop, the few lines
    the consumers read well under 1 ms.
    """
    if only is not None:
        text = _select(text, only)
    try:
        return {family.name: family for family in text_string_to_metric_families(text)}
    except ValueError as error:
        log.debug("unparsable /metrics: %s", error)
        return {}


def _select(text: str, names: tuple[str, ...]) -> str:
    kept = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(names):
            kept.append(line)
    return "\n".join(kept) + "\n"


class EngineScraper:
    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession | None],
        plan: Callable[[], Mapping[str, float]],
        timeout_s: Callable[[], float],
        consumers: Sequence[MetricsConsumer],
    ) -> None:
        self._session = session
        self._plan = plan
        self._timeout_s = timeout_s
        self._consumers = consumers
        self._wanted = tuple(sorted({name for c in consumers for name in c.families}))
        self._last: dict[str, float] = {}  # address → monotonic time of its last fetch
        self._periodic = Periodic("engine-scrape", self.scrape_due, self._tick_s)

    def _tick_s(self) -> float:
        return min(self._plan().values(), default=1.0)

    async def start(self) -> None:
        """One round now (load and the KV-check baseline are known at start), then a task."""
        await self.scrape_due()  # bounded: each fetch has a timeout
        self._periodic.start(first_now=False)

    async def stop(self) -> None:
        await self._periodic.stop()

    async def scrape_due(self) -> None:
        """Scrape every planned engine whose interval is (about) up."""
        plan, now, tick = self._plan(), time.monotonic(), self._tick_s()
        due = [
            a
            for a, interval in plan.items()
            if now - self._last.get(a, -interval) >= interval - tick / 2
        ]
        await asyncio.gather(*(self.scrape(a, min(plan[a], self._timeout_s())) for a in due))
        for address in set(self._last) - set(plan):
            del self._last[address]

    async def scrape(self, address: str, timeout_s: float | None = None) -> bool:
        """Fetch and hand out one engine's metrics now; whether it answered 200."""
        return await self.check(address, timeout_s) is None

    async def check(self, address: str, timeout_s: float | None = None) -> str | None:
        """`scrape`, answering why the engine did not answer 200 (None when it did)."""
        session = self._session()
        if session is None:
            return "not started"
        self._last[address] = time.monotonic()
        try:
            async with session.get(
                f"http://{address}/metrics",
                timeout=aiohttp.ClientTimeout(total=timeout_s or self._timeout_s()),
            ) as response:
                if response.status != 200:
                    return f"HTTP {response.status}"
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError) as error:
            return failure_reason(error)
        families = parse_families(text, self._wanted)
        for consumer in self._consumers:
            consumer.consume(address, families)
        return None
