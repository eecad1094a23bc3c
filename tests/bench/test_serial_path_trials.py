"""bench/serial_path_trials.py's candidates do what they say on the virtual clock, and each
leaves the simulator as it found it: a busy P's late listener slows serial push and leaves pull
alone; a post on D's model thread slows pull at once; cache_aware sends a prompt back to the
engine that holds it and every other one to the smallest tree; scheduling one step ahead
delays what arrives at a busy engine, not a request alone on an idle one."""

from __future__ import annotations

from typing import Any

from bench import fastsim
from bench.serial_path_trials import CacheAwareProxy, async_scheduling, busy_p, post_cost
from vllmsim.engine import Engine
from vllmsim.nixl.pull import PullConnector
from vllmsim.nixl.push import PushConnector
from vllmsim.profiles import GPU_8B


def _ms(mode: str, concurrency: int) -> float:
    return fastsim.mean_ttft_ms(GPU_8B, mode, concurrency, runs=1)


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


def test_cache_aware_returns_a_held_prompt_and_balances_the_rest() -> None:
    engines: Any = type("Cluster", (), {"prefill": [0, 1, 2], "decode": [0, 1]})()
    proxy = CacheAwareProxy(engines, "pull")
    assert [proxy._choose("p", key) for key in (7, 7, 8, 9, 10, 7)] == [0, 0, 1, 2, 0, 0]
    assert [proxy._choose("d", key) for key in (7, 8, 9)] == [0, 1, 0]


def test_scheduling_a_step_ahead_delays_arrivals_at_busy_engines_only() -> None:
    alone, loaded = _ms("push", 1), _ms("push", 8)
    with async_scheduling():
        assert abs(_ms("push", 1) - alone) < 3.0  # one idle step at most
        assert _ms("push", 8) > loaded + 3.0
    assert Engine._plan.__name__ == "_plan"
