"""The limits an operator sets hold for the sidecar, whatever its number of ext_proc processes:
each process admits its part of every max_in_flight and holds its part of the body budget."""

from __future__ import annotations

from extproc.config import parse_config
from extproc.process.workers import limits_share

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
