"""Turn per-run `vllm bench serve` results into the PR #187-shaped table, ratios and a plot.

A cell is the median TTFT over the requests of all runs pooled (the PR took the best mean of 4
runs, which one lucky run flatters; that figure is in the detail table too). Ratios are
cell / vllm-router's cell.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on a benchmark box
import matplotlib.pyplot as plt

Key = tuple[str, str, int]  # topology, config, concurrency
BASELINE = "vllm-router"


def cells(records: Iterable[dict]) -> dict[Key, dict[str, float]]:
    """(topology, config, C) → metrics over the requests of all successful runs, pooled.

    Pooling (rather than a median of per-run medians) matters here: with 2 × C prompts arriving
    at once, a run's TTFTs fall into prefill batches, and one run's median jumps between them.
    """
    grouped: dict[Key, list[dict]] = defaultdict(list)
    for rec in records:
        grouped[(rec["topology"], rec["config"], rec["concurrency"])].append(rec)
    out: dict[Key, dict[str, float]] = {}
    for key, recs in grouped.items():
        ok = [r for r in recs if "error" not in r and r.get("completed") and not r.get("failed")]
        cell: dict[str, float] = {"runs": len(ok), "attempts": len(recs)}
        ttfts = [t for r in ok for t in r["ttfts_ms"]]
        tpots = [t for r in ok for t in r["tpots_ms"]]
        if ttfts:
            cell |= {
                "median_ttft_ms": statistics.median(ttfts),
                "p99_ttft_ms": _p99(ttfts),
                "mean_ttft_ms": statistics.fmean(ttfts),
                "requests": len(ttfts),
                "best_mean_ttft_ms": min(r["mean_ttft_ms"] for r in ok),
            }
        if tpots:
            cell |= {"median_tpot_ms": statistics.median(tpots), "p99_tpot_ms": _p99(tpots)}
        out[key] = cell
    return out


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def ttft_table(
    table: dict[Key, dict[str, float]], topology: str, configs: list[str], concurrencies: list[int]
) -> list[str]:
    others = [c for c in configs if c != BASELINE]
    head = ["concurrency", *configs, *(f"{c} / router" for c in others if BASELINE in configs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for conc in concurrencies:
        values = {c: table.get((topology, c, conc), {}).get("median_ttft_ms") for c in configs}
        row = [str(conc), *(_fmt(values[c]) for c in configs)]
        base = values.get(BASELINE)
        if BASELINE in configs:
            row += [_fmt(values[c] / base, 2) if values[c] and base else "—" for c in others]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def detail_table(
    table: dict[Key, dict[str, float]], topology: str, configs: list[str], concurrencies: list[int]
) -> list[str]:
    lines = [
        "| concurrency | config | median TTFT | p99 TTFT | mean TTFT | best run's mean TTFT | "
        "median TPOT | p99 TPOT | requests | runs ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for conc in concurrencies:
        for config in configs:
            cell = table.get((topology, config, conc), {})
            lines.append(
                f"| {conc} | {config} | {_fmt(cell.get('median_ttft_ms'))} | "
                f"{_fmt(cell.get('p99_ttft_ms'))} | {_fmt(cell.get('mean_ttft_ms'))} | "
                f"{_fmt(cell.get('best_mean_ttft_ms'))} | {_fmt(cell.get('median_tpot_ms'), 2)} | "
                f"{_fmt(cell.get('p99_tpot_ms'), 2)} | {int(cell.get('requests', 0))} | "
                f"{int(cell.get('runs', 0))}/{int(cell.get('attempts', 0))} |"
            )
    return lines


def target_checks(
    table: dict[Key, dict[str, float]], topology: str, concurrencies: list[int]
) -> list[str]:
    """The benchmark's targets against vllm-router, one line each, with the misses."""

    def ttft(config: str, conc: int) -> float | None:
        return table.get((topology, config, conc), {}).get("median_ttft_ms")

    def misses(other: str, strict: bool, limit: int | None = None) -> list[int]:
        bad = []
        for conc in concurrencies:
            mine, theirs = ttft("push", conc), ttft(other, conc)
            if mine is None or theirs is None or (limit and conc > limit):
                continue
            if mine > theirs or (strict and mine == theirs):
                bad.append(conc)
        return bad

    checks = [
        ("push ≤ vllm-router at every concurrency", misses(BASELINE, False)),
        ("push < pull up to 64", misses("pull", True, 64)),
        ("push < serial-push up to 64", misses("serial-push", True, 64)),
    ]
    return [f"- {name}: " + ("met" if not bad else f"MISSED at C = {bad}") for name, bad in checks]


PUSH_TARGET = 0.95  # the data-parallel benchmark's aim: push ≤ 0.95 × vllm-router


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return mine / theirs if mine is not None and theirs else None


def p50_p99_table(
    table: dict[Key, dict[str, float]], topology: str, concurrencies: list[int]
) -> list[str]:
    """vllm-router and push side by side: median and p99 TTFT, each with push / router."""
    lines = [
        "| concurrency | vllm-router p50 | push p50 | push / router p50 | vllm-router p99 | "
        "push p99 | push / router p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for conc in concurrencies:
        row = [str(conc)]
        for metric in ("median_ttft_ms", "p99_ttft_ms"):
            theirs = table.get((topology, BASELINE, conc), {}).get(metric)
            mine = table.get((topology, "push", conc), {}).get(metric)
            row += [_fmt(theirs), _fmt(mine), _fmt(_ratio(mine, theirs), 2)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def ratio_checks(
    table: dict[Key, dict[str, float]], topology: str, concurrencies: list[int]
) -> list[str]:
    """push / vllm-router ≤ PUSH_TARGET at every C, for p50 and p99, with the misses."""
    lines = []
    for label, metric in (("p50", "median_ttft_ms"), ("p99", "p99_ttft_ms")):
        bad = []
        for conc in concurrencies:
            ratio = _ratio(
                table.get((topology, "push", conc), {}).get(metric),
                table.get((topology, BASELINE, conc), {}).get(metric),
            )
            if ratio is None or ratio > PUSH_TARGET:
                bad.append(conc)
        verdict = "met" if not bad else f"MISSED at C = {bad}"
        lines.append(f"- push / vllm-router ≤ {PUSH_TARGET} ({label} TTFT) at every C: {verdict}")
    return lines


def plot(
    table: dict[Key, dict[str, float]],
    topologies: list[str],
    configs: list[str],
    concurrencies: list[int],
    path: Path,
    engines: str = "vllmsim engines",
) -> None:
    """Top row: median TTFT against concurrency; bottom row: each configuration / vllm-router.
    `engines`: how the titles name the engines."""
    fig, axes = plt.subplots(
        2, len(topologies), figsize=(6 * len(topologies), 8), squeeze=False, height_ratios=[3, 2]
    )
    for column, topology in enumerate(topologies):
        top, bottom = axes[0][column], axes[1][column]
        base = {
            c: table.get((topology, BASELINE, c), {}).get("median_ttft_ms") for c in concurrencies
        }
        for index, config in enumerate(configs):
            style = {"marker": "o", "label": config, "color": f"C{index}"}  # same in both rows
            points = _points(table, topology, config, concurrencies)
            if points:
                top.plot(*zip(*points, strict=True), **style)
            ratios = [(c, v / base[c]) for c, v in points if base.get(c)]
            if ratios and config != BASELINE:
                bottom.plot(*zip(*ratios, strict=True), **style)
        top.set_yscale("log")
        top.set_ylabel("median TTFT (ms)")
        top.set_title(f"{topology}, {engines}, input 1024 / output 64")
        bottom.axhline(1.0, color="black", linewidth=0.8)
        bottom.set_ylabel("median TTFT / vllm-router's")
        bottom.set_xlabel("concurrency (prompts = 2 × concurrency)")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _points(
    table: dict[Key, dict[str, float]], topology: str, config: str, concurrencies: list[int]
) -> list[tuple[int, float]]:
    values = [
        (c, table.get((topology, config, c), {}).get("median_ttft_ms")) for c in concurrencies
    ]
    return [(c, v) for c, v in values if v is not None]
