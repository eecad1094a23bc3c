"""One /metrics page for every ext_proc process of a sidecar (`extproc.workers` above 1).

Each process counts the requests it took. The page on `metrics.port` carries every process's
series, each with a `worker` label ("0" for this process, then each worker's number), so that
one scrape sees all of them: `sum without (worker)` gives the sidecar's own figures.
`pd_extproc_worker_up{worker}` says whether a worker's page came (0: its series are missing
from this scrape).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = ["WORKER_LABEL", "merged_pages", "worker_pages"]

WORKER_LABEL = "worker"
_TIMEOUT = aiohttp.ClientTimeout(total=2)


async def worker_pages(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[bytes | None]:
    """Each worker's /metrics page (`urls`: their base URLs), None where none came in time."""
    return list(await asyncio.gather(*(_page(session, url) for url in urls)))


async def _page(session: aiohttp.ClientSession, url: str) -> bytes | None:
    try:
        async with session.get(url + "/metrics", timeout=_TIMEOUT) as response:
            return await response.read() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merged_pages(pages: Sequence[bytes | None]) -> bytes:
    """The page of every process: `pages[0]` this one's, then each worker's (None: missing).
    Parsing is the costly part (tens of ms a page): run it off the event loop."""
    families: dict[str, Metric] = {}
    up = GaugeMetricFamily(
        "pd_extproc_worker_up",
        "1 if this scrape got the ext_proc worker's own metrics, else 0 (its series are missing).",
        labels=[WORKER_LABEL],
    )
    for index, page in enumerate(pages):
        worker = str(index)
        up.add_metric([worker], 0 if page is None else 1)
        if page is None:
            continue
        for family in text_string_to_metric_families(page.decode()):
            into = families.get(family.name)
            if into is None:
                into = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            into.samples.extend(
                sample._replace(labels={**sample.labels, WORKER_LABEL: worker})
                for sample in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), up]))
    return generate_latest(registry)
