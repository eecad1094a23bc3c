"""Per-request diagnostics: each request's turn, route, what the index said each engine held
against what the engine found, the queues it met, and the requests that form the p99."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.cli import main
from tests.support.lab import KV_CACHE, ROUND_ROBIN, config_file


def _rows(out: Path, name: str) -> list[dict[str, object]]:
    lines = (out / f"{name}.requests.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_each_request_says_its_turn_route_cache_and_queues(tmp_path: Path) -> None:
    kv, rr = config_file(tmp_path, "kv", KV_CACHE), config_file(tmp_path, "rr", ROUND_ROBIN)
    out = tmp_path / "out"
    configs = ["--config", str(rr), "--config", str(kv)]
    workload = ["--workload", "multi-turn", "--concurrency", "4", "--requests", "24"]
    options = ["--turn-waves", "--prefill-kv-blocks", "512", "--per-request"]
    main(["--topology", "2P2D", *configs, *workload, *options, "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["prefill_kv_blocks"] == 512 and summary["run"]["turn_waves"]
    rows = _rows(out, "kv")
    assert len(rows) == 24
    # turn waves: every conversation's turn k before any turn k + 1
    assert [r["turn"] for r in rows] == sorted(r["turn"] for r in rows)
    later = [r for r in rows if r["turn"] > 0]
    # the index learnt the engines' base model: it credits the D that holds the last turn,
    # as much as that engine then finds cached
    held = [r for r in later if r["sidecar_view"]["decode"]["index_cached"] > 0]
    assert held
    assert all(
        r["d_leg"]["cached_tokens"] >= r["sidecar_view"]["decode"]["index_cached"] for r in held
    )
    first = rows[0]
    assert first["prefill"] in {"p0", "p1"} and first["decode"] in {"d0", "d1"}
    assert set(first["p_leg"]["queue_on_arrival"]) == {
        "waiting",
        "remote_wait",
        "running",
        "prefill_tokens",
    }
    # the TTFT's parts come in order
    p, d = first["p_leg"], first["d_leg"]
    assert 0 < p["arrived_ms"] <= p["submitted_ms"] < p["first_token_ms"] <= first["ttft_ms"]
    assert d["first_token_ms"] <= first["ttft_ms"]
    # when each was sent (from the run's start: turn waves send turn 1 after all of turn 0)
    # and its TPOT, to line the requests up against each other
    assert max(r["sent_ms"] for r in rows if r["turn"] == 0) < min(r["sent_ms"] for r in later)
    assert all(r["tpot_ms"] > 0 for r in rows)
    tail = (out / "kv.tail.md").read_text()
    slowest = max(r["ttft_ms"] for r in rows)
    assert f"| {slowest} |" in tail
    # round robin looked nothing up
    assert all(r["sidecar_view"]["decode"]["index_cached"] == 0 for r in _rows(out, "rr"))


def test_turn_waves_without_a_closed_loop_is_one_line(tmp_path: Path) -> None:
    config = config_file(tmp_path, "rr", ROUND_ROBIN)
    args = ["--topology", "1P1D", "--config", str(config), "--workload", "multi-turn"]
    with pytest.raises(SystemExit) as ended:
        main([*args, "--rate", "2", "--turn-waves", "--out", str(tmp_path / "out")])
    assert ended.value.code == (
        "pd-extproc-lab: --turn-waves paces a closed loop: give --concurrency, not a rate or trace"
    )
