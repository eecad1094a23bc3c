"""The run's output: DIR/summary.json, DIR/summary.md and, with matplotlib, DIR/ttft.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["markdown", "write"]


def _cell(value: Any) -> str:
    return "—" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _per_engine(figures: dict[str, int]) -> str:
    return " ".join(f"{name}:{value}" for name, value in figures.items())


def markdown(run: dict[str, Any], configs: list[dict[str, Any]]) -> str:
    """One row per configuration (times in ms of simulated time)."""
    head = (
        f"# Lab run: {run['topology']}, profile {run['profile']}, {run['workload']}, "
        f"seed {run['seed']}\n\n"
        f"Proxy costs (ms): intake {run['proxy']['intake_ms']:g}, answer "
        f"{run['proxy']['answer_ms']:g}, hop {run['proxy']['hop_ms']:g}. Goodput: TTFT ≤ "
        f"{run['slo_ttft_ms']:g} ms and TPOT ≤ {run['slo_tpot_ms']:g} ms.\n\n"
    )
    rows = [
        "| config | TTFT p50 | p90 | p99 | TPOT p50 | p99 | ok | failed | goodput (req/s) "
        "| P computed | P cached | D computed | D cached | decode-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        p, d = c["prefill"], c["decode"]
        rows.append(
            "| "
            + " | ".join(
                _cell(v)
                for v in (
                    c["name"],
                    c["ttft_ms"]["p50"],
                    c["ttft_ms"]["p90"],
                    c["ttft_ms"]["p99"],
                    c["tpot_ms"]["p50"],
                    c["tpot_ms"]["p99"],
                    c["ok"],
                    c["failed"],
                    c["goodput"]["per_s"],
                    p["computed_tokens"],
                    f"{100 * p['cached_share']:.1f} %",
                    d["computed_tokens"],
                    f"{100 * d['cached_share']:.1f} %",
                    f"{100 * c['decode_only_share']:.1f} %",
                )
            )
            + " |"
        )
    engines = ["", "| config | legs per engine | peak queue per engine |", "|---|---|---|"]
    for c in configs:
        p, d = c["prefill"], c["decode"]
        legs = _per_engine(p["legs_per_engine"] | d["legs_per_engine"])
        peaks = _per_engine(p["peak_queue"] | d["peak_queue"])
        engines.append(f"| {c['name']} | {legs} | {peaks} |")
    return head + "\n".join(rows + engines) + "\n"


def _plot(path: Path, configs: list[dict[str, Any]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    quantiles = ("p50", "p90", "p99")
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(configs) + 2), 3.5))
    width = 0.8 / len(quantiles)
    for i, q in enumerate(quantiles):
        values = [c["ttft_ms"][q] or 0.0 for c in configs]
        ax.bar([x + i * width for x in range(len(configs))], values, width, label=q)
    ax.set_xticks([x + width for x in range(len(configs))], [c["name"] for c in configs])
    ax.set_ylabel("TTFT (ms, simulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(out: Path, run: dict[str, Any], configs: list[dict[str, Any]]) -> list[Path]:
    """The files written."""
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.json"
    summary.write_text(json.dumps({"run": run, "configs": configs}, indent=2) + "\n")
    table = out / "summary.md"
    table.write_text(markdown(run, configs))
    written = [summary, table]
    plot = out / "ttft.png"
    if _plot(plot, configs):
        written.append(plot)
    return written
