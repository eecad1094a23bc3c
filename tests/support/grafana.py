"""The dashboard's queries as Grafana sends them to Prometheus, and a check that each gets data.

Grafana replaces its template variables before a query leaves: a multi-value variable with
"All" selected becomes its allValue (`.*`), one value becomes that value regex-escaped, and
`$__rate_interval` is max($__interval + scrape interval, 4 × scrape interval), with $__interval
no shorter than the data source's scrape interval. Variables of type query take their values
from `label_values(selector, label)`, which Grafana asks Prometheus for with the label-values
API. Unknown `$name`s (label_replace's "$1") are left as they are, as Grafana leaves them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ALL = ".*"
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$")


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref_id: str
    expr: str


def load(path: Path) -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(path.read_text())
    return dashboard


def panel_queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    """Every target of every panel, rows' nested panels included."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[PanelQuery]:
        for panel in panels:
            for target in panel.get("targets", []):
                yield PanelQuery(panel["title"], target["refId"], target["expr"])
            yield from walk(panel.get("panels", []))

    return list(walk(dashboard["panels"]))


def query_variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in dashboard["templating"]["list"] if v["type"] == "query"]


def rate_interval_s(scrape_interval_s: float, interval_s: float | None = None) -> float:
    interval = max(interval_s or 0.0, scrape_interval_s)
    return max(interval + scrape_interval_s, 4 * scrape_interval_s)


def interpolate(expr: str, values: dict[str, list[str] | None], scrape_interval_s: float) -> str:
    """`values`: variable → its selected values, None for "All"."""
    builtins = {
        "__rate_interval": f"{rate_interval_s(scrape_interval_s):g}s",
        "__interval": f"{scrape_interval_s:g}s",
    }

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in builtins:
            return builtins[name]
        if name not in values:
            return match.group(0)
        chosen = values[name]
        if chosen is None:
            return ALL
        escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", v) for v in chosen]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"

    return _VARIABLE.sub(replace, expr)


class Prometheus:
    """The two HTTP API calls Grafana makes for this dashboard."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url

    async def _get(self, path: str, params: dict[str, str]) -> Any:
        async with self.session.get(self.url + path, params=params) as response:
            body = await response.json()
            assert response.status == 200 and body["status"] == "success", (params, body)
            return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self._get("/api/v1/query", {"query": expr})
        result: list[dict[str, Any]] = data["result"]
        return result

    async def label_values(self, definition: str) -> list[str]:
        match = _LABEL_VALUES.match(definition.strip())
        assert match, f"not a label_values(selector, label) query: {definition}"
        selector, label = match.groups()
        values: list[str] = await self._get(f"/api/v1/label/{label}/values", {"match[]": selector})
        return values


def has_data(result: list[dict[str, Any]]) -> bool:
    """At least one series with a number (histogram_quantile of no traffic is NaN)."""
    return any(math.isfinite(float(series["value"][1])) for series in result)


async def variable_values(
    prometheus: Prometheus, dashboard: dict[str, Any], scrape_interval_s: float
) -> dict[str, list[str]]:
    """Each query variable's values, with the variables it depends on at "All"."""
    everything: dict[str, list[str] | None] = {v["name"]: None for v in query_variables(dashboard)}
    found = {}
    for variable in query_variables(dashboard):
        definition = interpolate(variable["definition"], everything, scrape_interval_s)
        found[variable["name"]] = await prometheus.label_values(definition)
    return found


def selections(found: dict[str, list[str]]) -> list[dict[str, list[str] | None]]:
    """All variables at "All", then each variable in turn at its first value."""
    everything: dict[str, list[str] | None] = dict.fromkeys(found)
    chosen = [everything]
    for name, values in found.items():
        if values:
            chosen.append({**everything, name: values[:1]})
    return chosen


async def queries_without_data(
    prometheus: Prometheus,
    dashboard: dict[str, Any],
    selection: dict[str, list[str] | None],
    scrape_interval_s: float,
) -> list[str]:
    missing = []
    for query in panel_queries(dashboard):
        expr = interpolate(query.expr, selection, scrape_interval_s)
        if not has_data(await prometheus.query(expr)):
            missing.append(f"{query.panel} [{query.ref_id}] {selection}: {expr}")
    return missing


@contextlib.asynccontextmanager
async def traffic(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> AsyncIterator[list[int]]:
    """Requests one after another until the block ends (rates need traffic in their window)."""
    statuses: list[int] = []

    async def send() -> None:
        while True:
            async with session.post(url + "/v1/completions", json=body) as response:
                statuses.append(response.status)

    task = asyncio.create_task(send())
    try:
        yield statuses
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_for_every_panel(
    prometheus: Prometheus,
    dashboard: dict[str, Any],
    scrape_interval_s: float,
    within_s: float,
    with_values: Collection[str] = (),
) -> dict[str, list[str]]:
    """Poll until the variables `with_values` have values and every query of every variable
    selection has data; returns the variables' values."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        found = await variable_values(prometheus, dashboard, scrape_interval_s)
        missing = [
            m
            for selection in selections(found)
            for m in await queries_without_data(prometheus, dashboard, selection, scrape_interval_s)
        ]
        if not missing and all(found[name] for name in with_values):
            return found
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"variables {found}; panels without data:\n" + "\n".join(missing))
        await asyncio.sleep(scrape_interval_s)
