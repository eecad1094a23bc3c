"""The limits an operator sets hold for the sidecar, whatever its number of ext_proc processes:
each process admits its part of every max_in_flight and holds its part of the body budget; and
each counts the others' load through one table, in a row of its own."""

from __future__ import annotations

from pathlib import Path

from extproc.config import LoadTableConfig, parse_config
from extproc.process.workers import _worker_config, limits_share, share_load

POOLS = {"prefill": {"endpoints": ["10.0.0.1:8000"]}, "decode": {"endpoints": ["10.0.0.2:8000"]}}


def test_each_process_admits_its_part_rounded_up() -> None:
    config = parse_config(
        POOLS | {"admission": {"enabled": True, "decode": {"max_in_flight": 10, "max_waiting": 4}}}
    )
    share = limits_share(config, 3)
    assert share.admission.decode.max_in_flight == 4  # 3 x 4 >= 10, the fewest that keep it
    assert share.admission.decode.max_waiting == 4  # the engines' own figure: not shared
    assert share.admission.prefill.max_in_flight is None  # no limit stays no limit
    assert limits_share(config, 1) is config


def test_each_process_holds_its_part_of_the_body_budget_but_one_whole_body() -> None:
    config = parse_config(
        POOLS | {"limits": {"max_body_bytes": 1000, "max_body_bytes_in_flight": 10_000}}
    )
    assert limits_share(config, 4).limits.body_budget_bytes == 2500
    assert limits_share(config, 40).limits.body_budget_bytes == 1000  # room for one body
    default = parse_config(POOLS)
    assert (
        limits_share(default, 2).limits.body_budget_bytes == default.limits.body_budget_bytes // 2
    )


def test_each_process_of_several_gets_the_load_table_and_its_own_row(tmp_path: Path) -> None:
    config = parse_config(POOLS)
    main = share_load(config, 3, 0, tmp_path)
    assert main.extproc.load_table == LoadTableConfig(
        path=str(tmp_path / "load.table"), rows=3, row=0
    )
    worker = _worker_config(config, 2, tmp_path, 3, tmp_path)
    assert worker["extproc"]["load_table"] == {
        "path": str(tmp_path / "load.table"),
        "rows": 3,
        "row": 2,
    }
    assert share_load(config, 1, 0, tmp_path) is config  # one process: nothing to share
    alone = parse_config(POOLS | {"extproc": {"share_load": False}})
    assert share_load(alone, 3, 0, tmp_path) is alone
    assert "load_table" not in _worker_config(alone, 1, tmp_path, 3, tmp_path)["extproc"]
