"""bench/serial_path_trials.py's candidates do what they say on the lab, and each
leaves the simulator as it found it: a busy P's late listener slows serial push and leaves pull
alone; a post on D's model thread slows pull at once; cache_aware sends a prompt back to the
engine that holds it and every other one to the smallest tree; scheduling one step ahead
delays what arrives at a busy engine, not a request alone on an idle one."""

from __future__ import annotations

from dataclasses import dataclass

from bench import pr187
from bench.serial_path_trials import (
    CacheAwarePicker,
    async_scheduling,
    busy_p,
    cache_aware,
    post_cost,
)
from extproc.policies import PickRequest
from vllmsim.engine import Engine
from vllmsim.nixl.pull import PullConnector
from vllmsim.nixl.push import PushConnector
from vllmsim.profiles import GPU_8B


def _ms(mode: str, concurrency: int) -> float:
    return pr187.mean_ttft_ms(GPU_8B, mode, concurrency, runs=1)


def test_a_late_listener_on_a_busy_p_slows_serial_push_only() -> None:
    before = {m: _ms(m, 8) for m in ("pull", "serial_push")}
    with busy_p(0.010, 0):
        during = {m: _ms(m, 8) for m in ("pull", "serial_push")}
    assert during["pull"] == before["pull"]
    assert during["serial_push"] > before["serial_push"] + 1.0
    assert _ms("serial_push", 8) == before["serial_push"]  # the patch is gone


def test_a_read_post_on_ds_model_thread_delays_pull() -> None:
    before = _ms("pull", 1)
    handlers = (PullConnector.start_recv, PushConnector._write)
    with post_cost(0.008):
        during = _ms("pull", 1)
    assert during > before + 5.0
    assert (PullConnector.start_recv, PushConnector._write) == handlers


@dataclass(frozen=True)
class _Endpoint:
    address: str


def test_cache_aware_returns_a_held_prompt_and_balances_the_rest() -> None:
    p, d = [_Endpoint(f"p{i}") for i in range(3)], [_Endpoint(f"d{i}") for i in range(2)]
    picker = CacheAwarePicker()

    def on(candidates: list[_Endpoint], key: bytes) -> int:
        return candidates.index(picker.pick(candidates, PickRequest(prefix=key)))

    assert [on(p, key) for key in (b"7", b"7", b"8", b"9", b"10", b"7")] == [0, 0, 1, 2, 0, 0]
    assert [on(d, key) for key in (b"17", b"18", b"19")] == [0, 1, 0]


def test_cache_aware_takes_the_sidecars_place_in_the_plan() -> None:
    """The warm-ups' prompt returns to the engines that computed it: at C = 8 the first
    prompt of the batch is a cache hit, which round robin sends elsewhere."""
    blind = _ms("pull", 8)
    with cache_aware():
        aware = _ms("pull", 8)
    assert aware != blind
    assert pr187.PREPARE.__name__ == "_as_configured"


def test_scheduling_a_step_ahead_delays_arrivals_at_busy_engines_only() -> None:
    alone, loaded = _ms("push", 1), _ms("push", 8)
    with async_scheduling():
        assert abs(_ms("push", 1) - alone) < 3.0  # one idle step at most
        assert _ms("push", 8) > loaded + 3.0
    assert Engine._plan.__name__ == "_plan"
