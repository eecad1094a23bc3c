"""Just enough PromQL reading to know which metrics and labels a Grafana dashboard needs.

Not a parser: it removes strings, range selectors and Grafana variables, then reads label
matchers, `by`/`without`/`on`/`ignoring` lists and bare identifiers. That is exact for the
expressions this repository writes (selectors, aggregations, rate/increase, quantiles).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_IDENT = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(rf"({_IDENT})?\s*\{{([^}}]*)\}}")
_MATCHER = re.compile(rf"({_IDENT})\s*(?:=~|!~|!=|=)")


@dataclass
class Query:
    expr: str
    metrics: set[str] = field(default_factory=set)
    # metric → label names its selector matches on
    selector_labels: dict[str, set[str]] = field(default_factory=dict)
    # labels in by (...) / without (...): each must exist on some metric of the query
    grouping_labels: set[str] = field(default_factory=set)


def _strip(expr: str) -> str:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values may hold anything
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range / subquery windows
    return re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables ($__rate_interval)


def parse(expr: str) -> Query:
    query = Query(expr)
    text = _strip(expr)
    for labels in _GROUPING.findall(text):
        query.grouping_labels |= {label.strip() for label in labels.split(",") if label.strip()}
    text = _GROUPING.sub(" ", text)
    for name, matchers in _SELECTOR.findall(text):
        if name and name not in _KEYWORDS:
            query.selector_labels.setdefault(name, set()).update(_MATCHER.findall(matchers))
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    for match in re.finditer(rf"({_IDENT})\s*(\()?", text):
        name, call = match.group(1), match.group(2)
        if call is None and name not in _KEYWORDS:
            query.metrics.add(name)
    query.metrics |= set(query.selector_labels)
    return query


def dashboard_queries(path: Path) -> list[Query]:
    """Every PromQL expression of every panel (rows and nested panels included)."""
    dashboard = json.loads(path.read_text())
    return [parse(expr) for expr in _exprs(dashboard.get("panels", []))]


def variable_queries(path: Path) -> list[Query]:
    """The selectors of the template variables' label_values(selector, label) queries."""
    variables = json.loads(path.read_text()).get("templating", {}).get("list", [])
    found = []
    for variable in variables:
        if variable.get("type") == "query":
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["definition"].strip())
            assert match, f"variable {variable['name']}: not label_values(selector, label)"
            query = parse(match.group(1))
            query.grouping_labels.add(match.group(2))  # the label must exist on the selector
            found.append(query)
    return found


def _exprs(panels: list[dict[str, Any]]) -> list[str]:
    found = []
    for panel in panels:
        found += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
        found += _exprs(panel.get("panels", []))
    return found
