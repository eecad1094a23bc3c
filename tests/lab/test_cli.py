"""`pd-extproc-lab`: configurations side by side, their figures in DIR/summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.cli import main
from tests.support.lab import KV_CACHE, ROUND_ROBIN, config_file, mooncake_trace


def test_each_config_gets_its_figures_by_its_files_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blind, cached = (
        config_file(tmp_path, "blind", ROUND_ROBIN),
        config_file(tmp_path, "kv", KV_CACHE),
    )
    out = tmp_path / "out"
    args = ["--topology", "1P2D", "--config", str(blind), "--config", str(cached)]
    main([*args, "--workload", "seed", "--concurrency", "2", "--seed", "4", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert [c["name"] for c in summary["configs"]] == ["blind", "kv"]
    for figures in summary["configs"]:
        assert set(figures["ttft_ms"]) == {"p50", "p90", "p99"}
        assert set(figures["tpot_ms"]) == {"p50", "p99"}
        assert (figures["ok"], figures["failed"]) == (4, 0)
        assert set(figures["prefill"]["peak_queue"]) == {"p0"}
        assert set(figures["decode"]["peak_queue"]) == {"d0", "d1"}
        assert figures["goodput"]["requests"] <= 4
    assert summary["run"]["topology"] == "1P2D" and summary["run"]["requests"] == 4
    table = (out / "summary.md").read_text()
    assert "| blind |" in table and "| kv |" in table
    assert "kv: simulated" in capsys.readouterr().err  # the progress line


def test_a_users_mistake_is_one_line(tmp_path: Path) -> None:
    one, out = ["--concurrency", "1"], ["--out", str(tmp_path / "out")]
    config = config_file(tmp_path, "a", ROUND_ROBIN)
    with pytest.raises(SystemExit) as ended:
        main(["--topology", "2P", "--config", str(config), "--workload", "seed", *one, *out])
    assert ended.value.code == "pd-extproc-lab: --topology '2P': write it as xPyD, e.g. 2P2D"
    with pytest.raises(SystemExit) as ended:
        main(["--topology", "1P1D", "--config", str(config), "--trace", "nope.jsonl", *out])
    assert str(ended.value.code).startswith("pd-extproc-lab: cannot read the trace nope.jsonl")


def test_a_prompt_past_the_profiles_context_fails_unless_it_is_raised(tmp_path: Path) -> None:
    config = config_file(tmp_path, "a", ROUND_ROBIN)
    trace = mooncake_trace(
        tmp_path / "long.jsonl",
        [{"timestamp": 0, "input_length": 9000, "output_length": 4, "hash_ids": [1]}],
    )
    args = ["--topology", "1P1D", "--config", str(config), "--trace", str(trace)]
    out = tmp_path / "out"
    main([*args, "--out", str(out)])  # gpu-8b: max_model_len 8192
    (figures,) = json.loads((out / "summary.json").read_text())["configs"]
    assert (figures["ok"], figures["failures_by_status"]) == (0, {"400": 1})
    main([*args, "--max-model-len", "16384", "--out", str(out)])
    (figures,) = json.loads((out / "summary.json").read_text())["configs"]
    assert (figures["ok"], figures["failed"]) == (1, 0)


def test_tokenize_sends_text_the_sidecar_tokenizes_at_the_given_costs(tmp_path: Path) -> None:
    config = config_file(tmp_path, "kv", KV_CACHE)
    out = tmp_path / "out"
    args = ["--topology", "1P1D", "--config", str(config), "--workload", "shared-prefix"]
    slow = ["--tokenize-us-per-token", "2000", "--tokenize-max-pending", "1"]
    main([*args, "--concurrency", "4", "--tokenize", *slow, "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["tokenizer"] == {
        "us_per_token": 2000,
        "handoff_ms": 0.4,
        "workers": 2,
        "max_pending": 1,
    }
    (figures,) = summary["configs"]
    assert figures["failed"] == 0
    # 2 ms a token: every prompt's ids are past the sidecar's 1 s budget, or the queue full
    assert set(figures["kv_untokenized"]) == {"queue_full", "timeout"}, figures["kv_untokenized"]
    main([*args, "--concurrency", "4", "--out", str(out)])  # token ids: nothing to tokenize
    (figures,) = json.loads((out / "summary.json").read_text())["configs"]
    assert figures["kv_untokenized"] == {}
    with pytest.raises(SystemExit) as ended:
        main([*args, "--concurrency", "1", "--tokenize", "--tokenize-workers", "0", "--out", "x"])
    assert ended.value.code == (
        "pd-extproc-lab: --tokenize-workers and --tokenize-max-pending must be at least 1"
    )
