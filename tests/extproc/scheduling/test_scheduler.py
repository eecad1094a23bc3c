"""The scheduler: which D and P serve a request, decided under the request's own config."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import pytest

from extproc.config import Config, DecisionConfig, parse_config
from extproc.errors import NoHealthyDecode, Shed
from extproc.metrics import Metrics
from extproc.policies import PickRequest, build_picker
from extproc.roles import Role
from extproc.scheduling.pool import EndpointState, Pool
from extproc.scheduling.scheduler import DecodeAlone, Scheduler, WithPrefill
from extproc.scheduling.subset_hint import Subset

P1, P2, D1, D2 = "127.0.0.1:8100", "127.0.0.1:8101", "127.0.0.1:8200", "127.0.0.1:8201"
POOLS = {"prefill": {"endpoints": [P1, P2]}, "decode": {"endpoints": [D1, D2]}}
THRESHOLD = {"decision": {"mode": "threshold", "max_prompt_tokens": 10}}
SHORT, LONG = PickRequest("m", prompt_bytes=40), PickRequest("m", prompt_bytes=41)  # 4 B/token


def config(**sections: Any) -> Config:
    return parse_config(POOLS | sections)


def scheduler(cfg: Config) -> Scheduler:
    prefill, decode = (
        Pool(role, cfg.static_addresses(role), build_picker("round_robin"))
        for role in (Role.PREFILL, Role.DECODE)
    )
    return Scheduler(cfg, prefill, decode, Metrics())


def in_flight(s: Scheduler) -> dict[str, int]:
    return {e.address: e.in_flight for e in (*s.prefill, *s.decode) if e.in_flight}


def test_a_disaggregated_pick_counts_d_and_p_and_names_a_fallback_p() -> None:
    s = scheduler(config())
    with ExitStack() as inflight:
        picked = s.pick(LONG, inflight, config())
        assert isinstance(picked, WithPrefill)
        assert (picked.decodes, picked.prefill, picked.fallback) == ([D1, D2], P1, P2)
        assert in_flight(s) == {P1: 1, D1: 1}
        assert picked.decode_counted.state.address == D1
    assert in_flight(s) == {}


def test_the_decision_is_a_type_with_its_reason_and_counts_no_p() -> None:
    cfg = config(**THRESHOLD)
    s = scheduler(cfg)
    with ExitStack() as inflight:
        alone = s.pick(SHORT, inflight, cfg)
        assert isinstance(alone, DecodeAlone) and alone.reason == "short_prompt"
        assert in_flight(s) == {D1: 1}
        assert isinstance(s.pick(LONG, inflight, cfg), WithPrefill)


def test_the_settings_are_the_callers_snapshot_not_the_schedulers_config() -> None:
    s = scheduler(config())  # built with the decision off
    with ExitStack() as inflight:
        assert isinstance(s.pick(SHORT, inflight, config(**THRESHOLD)), DecodeAlone)
        assert isinstance(s.pick(SHORT, inflight, config()), WithPrefill)


def test_prefill_admission_sheds_only_a_request_that_uses_p() -> None:
    limits = {"prefill": {"max_in_flight": 1}}
    cfg = config(admission={"enabled": True} | limits, **THRESHOLD)
    s = scheduler(cfg)
    for state in s.prefill:
        state.in_flight = 1  # both prefills at their limit
    with ExitStack() as inflight:
        assert isinstance(s.pick(SHORT, inflight, cfg), DecodeAlone)
        with pytest.raises(Shed, match="the prefill engines are saturated"):
            s.pick(LONG, inflight, cfg)


def test_decodes_only_for_a_passthrough_and_503_without_a_healthy_one() -> None:
    cfg = config()
    s = scheduler(cfg)
    with ExitStack() as inflight:
        picked = s.pick_decodes(PickRequest(), inflight, cfg, fallbacks=0)
        assert (picked.decodes, picked.reason) == ([D1], "passthrough")
        assert in_flight(s) == {D1: 1}
    for address in (D1, D2):
        s.decode.set_healthy(address, False)
    with ExitStack() as inflight, pytest.raises(NoHealthyDecode, match="no healthy decode"):
        s.pick(LONG, inflight, cfg)


def test_a_reload_swaps_the_groups_and_modes() -> None:
    s = scheduler(config())
    P3, D3 = "127.0.0.1:8102", "127.0.0.1:8202"
    s.reload(
        config(
            dispatch={"mode": "pull"},
            models={"m": {"prefill": {"endpoints": [P3]}, "decode": {"endpoints": [D3]}}},
        )
    )
    assert str(s.prefill_mode(P1)) == "pull"
    assert s.group("m").members == {Role.PREFILL: {P3}, Role.DECODE: {D3}}
    assert s.group("other") is s.group("") and s.decodes_of(P1) == {D1, D2}
    assert s.decodes_of(P3) == {D3}


def test_ds_rank_and_a_fallback_that_has_that_rank() -> None:
    """Envoy's connect-failure fallback gets the same X-data-parallel-rank: a server with fewer
    ranks would refuse it (400), so it is not offered."""
    pools = {
        "prefill": {"endpoints": [P1]},
        "decode": {
            "endpoints": [D1, {"address": D2, "data_parallel_size": 1}],
            "data_parallel_size": 2,
        },
    }
    cfg = parse_config(pools)
    s = scheduler(cfg)
    with ExitStack() as inflight:
        first = s.pick(LONG, inflight, cfg)  # D1, rank 0: D2 has a rank 0 of its own (1 of 1)
        second = s.pick(LONG, inflight, cfg)  # D2 (round robin), no ranks: D1 may serve it
        third = s.pick(LONG, inflight, cfg)  # D1, rank 1: D2 has none
        assert (first.decodes, first.decode_counted.rank) == ([D1, D2], 0)
        assert (second.decodes, second.decode_counted.rank) == ([D2, D1], None)
        assert (third.decodes, third.decode_counted.rank) == ([D1], 1)


def test_members_down_are_no_room_for_admission() -> None:
    """A role is as saturated as its least saturated healthy member: a decode that is down
    leaves the saturated one to shed (429), and with every member down the answer is 503."""
    cfg = config(admission={"enabled": True, "decode": {"max_in_flight": 1}})
    s = scheduler(cfg)
    d1, d2 = s.decode.get(D1), s.decode.get(D2)
    assert d1 is not None and d2 is not None
    d1.in_flight = 1  # at its limit
    s.decode.set_healthy(D2, False)  # idle, but down
    with ExitStack() as inflight, pytest.raises(Shed) as shed:
        s.pick(LONG, inflight, cfg)
    assert shed.value.status == 429
    d2.in_flight = 1  # its requests still finishing
    s.decode.set_healthy(D1, False)
    with ExitStack() as inflight, pytest.raises(NoHealthyDecode) as none:
        s.pick(LONG, inflight, cfg)
    assert none.value.status == 503


def test_a_passthrough_gets_one_fallback_and_a_subsets_503_says_so() -> None:
    cfg = config(decode={"endpoints": [D1, D2, "127.0.0.1:8202"]})
    s = scheduler(cfg)
    with ExitStack() as inflight:
        assert s.pick_decodes(PickRequest(), inflight, cfg).decodes == [D1, D2]
    elsewhere = Subset.of(["10.9.9.9:8000"])
    with ExitStack() as inflight, pytest.raises(NoHealthyDecode) as refused:
        s.pick_decodes(PickRequest(), inflight, cfg, subset=elsewhere)
    assert str(refused.value) == (
        "503 no healthy decode endpoint among the 1 the gateway allowed (its subset hint); "
        "retry later"
    )


def test_after_a_reload_both_pools_still_pick_and_members_can_be_set() -> None:
    s = scheduler(config())
    s.reload(config(prefill={"endpoints": [P1, P2], "policy": "least_request"}))
    with ExitStack() as inflight:
        picked = s.pick(LONG, inflight, config())
        assert isinstance(picked, WithPrefill) and picked.prefill in (P1, P2)
    # the pools' own policies (the probe's pick of a decode) are the reloaded ones
    assert s.prefill.pick() is not None and s.decode.pick() is not None
    s.set_group_members("", Role.DECODE, [D2])
    assert s.group("").members[Role.DECODE] == {D2}


def test_admission_exports_each_roles_saturation() -> None:
    metrics = Metrics()
    cfg = config(admission={"enabled": True, "decode": {"max_in_flight": 4}})
    prefill, decode = (
        Pool(role, cfg.static_addresses(role), build_picker("round_robin"))
        for role in (Role.PREFILL, Role.DECODE)
    )
    s = Scheduler(cfg, prefill, decode, metrics)
    for state in s.decode:
        state.in_flight = 2
    with ExitStack() as inflight:
        s.pick(LONG, inflight, cfg)
    saturation = metrics.registry.get_sample_value("pd_extproc_pool_saturation", {"role": "decode"})
    assert saturation == 0.5


def test_a_decode_that_left_its_pool_is_forgotten_by_the_decision() -> None:
    cfg = DecisionConfig(
        mode="load_aware", bytes_per_token=1.0, pd_overhead_ms=1000.0, max_stall_ms=60.0
    )
    s = scheduler(config())
    busy, idle = EndpointState(D1, in_flight=3), EndpointState(P1)
    spend = [s.decider.decide(cfg, 0, D1, busy, idle, prompt_tokens=700) for _ in range(2)]
    assert [d.decode_only for d in spend] == [True, False]  # a 40.6 ms stall, a 60 ms bucket
    s.forget(D1)
    assert s.decider.decide(cfg, 0, D1, busy, idle, prompt_tokens=700).decode_only


def test_a_pick_gets_one_fallback_decode_and_a_subsets_503_names_the_role_it_lacks() -> None:
    D3 = "127.0.0.1:8202"
    cfg = config(decode={"endpoints": [D1, D2, D3]})
    s = scheduler(cfg)
    with ExitStack() as inflight:
        picked = s.pick(LONG, inflight, cfg)
        assert picked.decodes == [D1, D2]
    for allowed, role in (([P1], "decode"), ([D1], "prefill")):
        with ExitStack() as inflight, pytest.raises(Exception) as refused:
            s.pick(LONG, inflight, cfg, subset=Subset.of(allowed))
        assert str(refused.value) == (
            f"503 no healthy {role} endpoint among the 1 the gateway allowed (its subset "
            "hint); retry later"
        )


def test_the_cached_tokens_are_counted_where_each_role_was_routed() -> None:
    metrics = Metrics()
    cfg = config(dispatch={"no_healthy_prefill": "decode_only"})
    prefill, decode = (
        Pool(role, cfg.static_addresses(role), build_picker("round_robin"))
        for role in (Role.PREFILL, Role.DECODE)
    )
    s = Scheduler(cfg, prefill, decode, metrics)

    def counted(role: str) -> tuple[float | None, float | None]:
        return tuple(  # type: ignore[return-value]
            metrics.registry.get_sample_value(f"pd_extproc_kv_{name}_total", {"role": role})
            for name in ("cached_prompt_tokens", "routed_prompt_tokens")
        )

    wanted = PickRequest("m", prompt_tokens=100, cached={D1: 60, P1: 30, D2: 90, P2: 90})
    with ExitStack() as inflight:
        assert isinstance(s.pick(wanted, inflight, cfg), WithPrefill)  # D1 and P1
    assert (counted("decode"), counted("prefill")) == ((60, 100), (30, 100))
    short = PickRequest("m", prompt_bytes=40, prompt_tokens=10, cached={D2: 10})
    threshold = config(**THRESHOLD)
    with ExitStack() as inflight:
        assert isinstance(s.pick(short, inflight, threshold), DecodeAlone)  # D2, decided
    assert counted("decode") == (60 + 10, 100 + 10)
    for address in (P1, P2):
        s.prefill.set_healthy(address, False)
    with ExitStack() as inflight:
        assert isinstance(s.pick(wanted, inflight, cfg), DecodeAlone)  # D1: no P at all
    assert counted("decode") == (60 + 10 + 60, 100 + 10 + 100)
    assert counted("prefill") == (30, 100)


def test_the_decision_weighs_what_the_chosen_p_holds() -> None:
    """D holds all but 64 of 2000 tokens: alone is sooner, unless P holds as much (then its
    path is short too, and D's 8 running requests would pay the stall for little)."""
    cfg = config(decision={"mode": "load_aware"})
    for p_held, expected in ((0, DecodeAlone), (1936, WithPrefill)):
        s = scheduler(cfg)
        d1 = next(state for state in s.decode if state.address == D1)
        d1.in_flight, d1.kv_usage = 8, 0.2  # 8 running besides this request
        wanted = PickRequest("m", prompt_bytes=0, prompt_tokens=2000, cached={D1: 1936, P1: p_held})
        with ExitStack() as inflight:
            assert isinstance(s.pick(wanted, inflight, cfg), expected), p_held
