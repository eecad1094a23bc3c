"""The fidelity table's pure parts (bench/lab_fidelity.py): every cell gets a line, a miss of
±10 % on p50 or p99 is bold and fails the cell, the engines' step lateness decides "on time",
and the lab sends the process run's prompts. No process and no timing."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from bench.lab_fidelity import (
    Cell,
    floors,
    instant_cost,
    lab_requests,
    lateness,
    rows,
    table,
    tally,
    warmups,
)
from tests.support.tokenizer import tiny_tokenizer
from vllmsim.profiles import GPU_8B


def _row(cell: Cell, process: tuple[float, float], lab: tuple[float, float], late: float) -> dict:
    p50, p99 = process
    return {
        "cell": cell,
        "process": {
            "ttft_ms": {"p50": p50, "p99": p99},
            "lateness": {"mean_ms": late, "tail_share": 0.0},
        },
        "lab": {"ttft_ms": {"p50": lab[0], "p99": lab[1]}},
    }


def test_every_cell_has_a_line_and_a_miss_is_bold() -> None:
    hit = Cell("1P1D", "seed", "rr", 1)
    p99_miss = Cell("1P1D", "seed", "rr", 2)
    lines = table(
        [
            _row(p99_miss, (100.0, 200.0), (105.0, 160.0), 0.4),
            _row(hit, (100.0, 200.0), (109.0, 181.0), 0.4),
        ]
    )
    assert len(lines) == 2 + 2  # header, rule, one line per cell
    first, second = lines[2:]
    assert first.startswith(
        "| 1P1D | seed | rr | 1 | 100.0 | 109.0 | 1.09 | 200.0 | 181.0 | 0.91 |"
    )
    assert first.endswith("| yes | 0.40, 0.0% | yes |")
    assert "| 1.05 |" in second and "| **0.80** |" in second
    assert "| **no** | 0.40, 0.0% | yes |" in second


def test_late_engines_are_not_on_time_and_the_tally_counts_them_apart() -> None:
    late = _row(Cell("2P2D", "shared-prefix", "kv", 16), (100.0, 300.0), (100.0, 300.0), 1.5)
    timely = _row(Cell("1P1D", "seed", "rr", 1), (100.0, 200.0), (150.0, 200.0), 0.2)
    lines = table([late, timely])
    assert lines[-1].endswith("| yes | 1.50, 0.0% | **no** |")
    assert lines[2].endswith("| **no** | 0.20, 0.0% | yes |")
    assert tally([late, timely]) == (
        "1 of 2 cells within ±10 % on p50 and p99; 0 of the 1 whose engines ran on time"
    )


def test_a_cell_without_a_process_run_is_listed_unjudged() -> None:
    row = {"cell": Cell("1P1D", "seed", "rr", 4), "process": None, "lab": {"ttft_ms": {}}}
    (line,) = table([row])[2:]
    assert line == "| 1P1D | seed | rr | 4 | — | — | — | — | — | — | — | — | — |"


def test_lateness_is_the_mean_per_step_and_the_share_past_10_ms() -> None:
    delta = {
        "steps": 200,
        "planned_s": 2.0,
        "late_s": 0.3,
        "buckets_ms": {"1": 150, "10": 44, "50": 6},
    }
    assert lateness(delta) == {"mean_ms": 1.5, "tail_share": 0.03}
    assert lateness({"steps": 0, "late_s": 0.0, "buckets_ms": {}}) is None


def test_the_lab_sends_the_processes_prompts_as_their_token_ids(tmp_path: Path) -> None:
    """Both workloads: the lab's prompts are the rows the client sends, tokenized as the
    engines tokenize them (the BOS included), in the same order; the seed plan's are PR
    #187's 1024 tokens with 64 out."""
    folder = tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for workload, length in (("seed", 1024), ("shared-prefix", 1 + 1024 + 64)):
        cell = Cell("1P1D", workload, "rr", 8)
        sent = rows(cell, 24, folder)
        lab = lab_requests(cell, 24, folder)
        assert [r.prompt for r in lab] == [tokenizer.encode(r["prompt"]).ids for r in sent]
        assert {len(r.prompt) for r in lab} == {length}
        assert {r.output_tokens for r in lab} == {64}
    assert [warmups(c) for c in (1, 2, 4, 8, 16)] == [2, 2, 4, 8, 8]


def test_instant_engines_on_the_lab_are_the_processes_instant_flags() -> None:
    """The floor's lab side runs the cost the processes' engines get from INSTANT."""
    cost = instant_cost("gpu-8b")
    assert (cost.step_base_ms, cost.prefill_per_token_ms) == (1.0, 0.001)
    assert (cost.decode_per_seq_ms, cost.api_overhead_ms) == (0.0, 0.0)
    assert cost.kv_bandwidth_gbps == GPU_8B.kv_bandwidth_gbps  # the rest is the profile's
    instant_row = _row(Cell("1P1D", "seed", "rr", 1, instant=True), (20.0, 30.0), (10.0, 12.0), 0.1)
    assert "| 1P1D | seed | rr, instant engines | 1 |" in table([instant_row])[2]


def test_the_floor_sets_each_cells_gap_beside_its_instant_twins() -> None:
    cell = Cell("2P2D", "shared-prefix", "rr", 4)
    twin = Cell("2P2D", "shared-prefix", "rr", 4, instant=True)
    alone = Cell("2P2D", "shared-prefix", "rr", 8)  # no instant run: no line
    lines = floors(
        [
            _row(cell, (80.0, 180.0), (67.5, 135.0), 1.3),
            _row(twin, (30.0, 70.0), (12.0, 20.0), 1.0),
            _row(alone, (90.0, 300.0), (68.0, 250.0), 1.3),
        ]
    )
    assert lines[2:] == ["| 2P2D | shared-prefix | rr | 4 | 12.5 | 18.0 | 45.0 | 50.0 |"]
