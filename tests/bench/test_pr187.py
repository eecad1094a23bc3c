"""PR #187's plan on the lab: the product's scheduler with each column's dispatch mode gives
the PR's order at C = 8 (parallel push first, serial push last), each mode's ratio to pull
within the tolerance there, and the fidelity table reports every cell and flags a miss.
Simulated time only (one run per cell)."""

from __future__ import annotations

from bench.pr187 import MODES, ROWS, fidelity, mean_ttft_ms, order, ratios, table
from vllmsim.profiles import GPU_8B


def test_the_prs_order_and_ratios_at_c8_on_the_lab() -> None:
    row = table(GPU_8B, (8,), runs=1)[8]
    assert order(row) == order(ROWS[8]) == "push < pull < serial_push"
    for mode, ratio in ratios(row).items():
        assert abs(ratio / ratios(ROWS[8])[mode] - 1) <= 0.15


def test_parallel_push_overlaps_the_legs_on_one_idle_pair() -> None:
    """At C = 1 the parallel plan saves about D's share of a serial request (its queueing
    for KV and the hops between the legs): a mode the lab did not apply would save nothing."""
    serial, parallel = (mean_ttft_ms(GPU_8B, m, 1, runs=1) for m in ("serial_push", "push"))
    assert parallel < serial - 10.0


def test_the_table_has_every_cell_and_flags_a_miss() -> None:
    rows = {1: dict(ROWS[1]), 8: {**ROWS[8], "serial_push": ROWS[8]["pull"] * 0.9}}
    lines = fidelity(rows)
    cells = [line for line in lines if line.startswith(("| 1 |", "| 8 |"))]
    assert len(cells) == 2 * len(MODES) + 2  # every mode at each C, then each C's order
    assert "| 8 | serial_push | 184 | 143.1 |" in "\n".join(lines)
    assert any(line.startswith("| 8 | serial_push") and "**no**" in line for line in cells)
    assert any(line.startswith("| 8 | push <") and line.endswith("**no** |") for line in cells)
    assert not any(line.startswith("| 1 |") and "**no**" in line for line in cells)
