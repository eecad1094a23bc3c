"""vllm-project/router PR #187's push table: what the `gpu-8b` profile is fitted to and checked
against.

Setup as the PR states it: 4 prefill + 4 decode GPU engines, `vllm bench serve --dataset-name
random --random-input-len 1024 --random-output-len 64 --random-range-ratio 0`, 2 x C prompts at
`--max-concurrency` C; each cell is the best mean TTFT (ms) of 4 runs. Columns: NIXL pull with
the sequential router, NIXL push with the sequential router, NIXL push with both legs at once.
"""

from __future__ import annotations

import math

MODES = ("pull", "serial_push", "push")
ROWS: dict[int, dict[str, float]] = {
    1: {"pull": 74.0, "serial_push": 73.0, "push": 71.0},
    8: {"pull": 159.0, "serial_push": 184.0, "push": 123.0},
    32: {"pull": 191.0, "serial_push": 226.0, "push": 182.0},
    128: {"pull": 248.0, "serial_push": 270.0, "push": 216.0},
    512: {"pull": 2095.0, "serial_push": 2171.0, "push": 2087.0},
}
TOLERANCE = 0.15  # each ratio to pull, and the absolute figure up to ABSOLUTE_UP_TO
ABSOLUTE_UP_TO = 32


def order(row: dict[str, float]) -> str:
    return " < ".join(sorted(row, key=row.__getitem__))


def ratios(row: dict[str, float]) -> dict[str, float]:
    """Each push mode's figure over pull's."""
    return {m: row[m] / row["pull"] for m in MODES[1:]}


def interpolated(concurrency: int) -> dict[str, float]:
    """A row the PR does not have, log-log between its two neighbouring rows: what a smooth
    curve through the PR's rows gives (the check of the profile off its fitted points)."""
    below = max(c for c in ROWS if c <= concurrency)
    above = min(c for c in ROWS if c >= concurrency)
    if below == above:
        return dict(ROWS[below])
    w = math.log(concurrency / below) / math.log(above / below)
    return {
        m: math.exp((1 - w) * math.log(ROWS[below][m]) + w * math.log(ROWS[above][m]))
        for m in MODES
    }
