"""The scheduler: which D and P serve a request, decided under the request's own config."""

from __future__ import annotations

import itertools
import time
from contextlib import ExitStack
from typing import Any

import pytest

from extproc.config import Config, DecisionConfig
from extproc.errors import NoHealthyDecode, NoHealthyPrefill, Shed
from extproc.metrics import Metrics
from extproc.policies import PickRequest, build_picker
from extproc.roles import Role
from extproc.scheduling.decision import Decider
from extproc.scheduling.pool import EndpointState, Pool
from extproc.scheduling.scheduler import DecodeAlone, Scheduler, WithPrefill
from extproc.scheduling.shared_load import SharedLoad, table_bytes
from extproc.scheduling.subset_hint import Subset
from tests.support.routing import fixed_routing_config

P1, P2, D1, D2 = "127.0.0.1:8100", "127.0.0.1:8101", "127.0.0.1:8200", "127.0.0.1:8201"
POOLS = {"prefill": {"endpoints": [P1, P2]}, "decode": {"endpoints": [D1, D2]}}
THRESHOLD = {"decision": {"mode": "threshold", "max_prompt_tokens": 10}}
SHORT, LONG = PickRequest("m", prompt_bytes=40), PickRequest("m", prompt_bytes=41)  # 4 B/token


def config(**sections: Any) -> Config:
    return fixed_routing_config(POOLS | sections)


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
    cfg = fixed_routing_config(pools)
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


def test_a_prompt_sent_to_prefill_alone_is_told_to_the_other_processes() -> None:
    """Two processes of one sidecar: the first sends a 2000-token prompt decode-only to the
    idle D1, and the second reads it in their table (D1's `peer_alone_tokens` at its pick),
    as the decision's own pending prompts of one process would count it."""
    cfg = config(decision={"mode": "load_aware"})
    table = bytearray(table_bytes(2))
    first, second = scheduler(cfg), scheduler(cfg)
    for row, s in enumerate((first, second)):
        shared = SharedLoad(table, 2, row, time.monotonic)
        s.prefill.share(shared)
        s.decode.share(shared)
    with ExitStack() as inflight:
        assert isinstance(
            first.pick(PickRequest("m", prompt_bytes=8000), inflight, cfg), DecodeAlone
        )
        assert first.decider.alone(D1)[0] == 2000
        second.decode.pick()
        d1 = second.decode.get(D1)
        assert d1 is not None and (d1.peer_in_flight, d1.peer_alone_tokens) == (1, 2000)


def test_the_stall_one_process_spends_on_d_is_spent_for_the_others_too() -> None:
    """Two processes, one D running another router's request, a 30 ms stall budget, 11.6 ms a
    short prompt's stall: each sends one prompt decode-only, and the second process's next
    one goes through P, its bucket 30 - 2 x 11.6 (alone, it would still hold 18.4 ms)."""
    cfg = config(
        decode={"endpoints": [D1]},
        decision={
            "mode": "load_aware",
            "bytes_per_token": 1.0,
            "max_stall_ms": 30.0,
            "stall_budget_ms_per_token": 0.3,
        },
    )
    table = bytearray(table_bytes(2))
    first, second = scheduler(cfg), scheduler(cfg)
    ticks = itertools.count(1)
    for row, s in enumerate((first, second)):
        shared = SharedLoad(table, 2, row, time.monotonic)
        s.prefill.share(shared)
        s.decode.share(shared)
        s.decider = Decider(Metrics(), clock=lambda: next(ticks) * 1e-9)  # about no refill
        d1 = s.decode.get(D1)
        assert d1 is not None
        d1.foreign = 1.0

    def pick(s: Scheduler) -> type:
        with ExitStack() as inflight:
            return type(s.pick(PickRequest("m", prompt_bytes=200), inflight, cfg))

    assert [pick(second), pick(first), pick(second)] == [DecodeAlone, DecodeAlone, WithPrefill]
    seen_by_second = second.decode.get(D1)
    assert seen_by_second is not None and seen_by_second.shared is not None
    told = seen_by_second.shared.peers(Role.DECODE, D1)
    assert told.stall_credit_us == 6_800  # 30 - 2 x 11.6, as the first left it
    seen_by_second.refresh_peers()
    assert seen_by_second.peer_stall_at == first.decider.bucket(D1)[1]  # seconds, as told
    first.forget(D1)  # D1 left the first's pool: its slot in the table is free again
    assert seen_by_second.shared.peers(Role.DECODE, D1).stall_at_ns == 0
    own = first.decode.get(D1)
    assert own is not None and own.shared is not None
    slot = own.shared._own[own.shared._key(Role.DECODE, D1)]
    assert not any(own.shared._words[slot + 1 : slot + 8])  # nothing left in it


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


def data_parallel(policy: str) -> Config:
    """P1 and D1 with 2 ranks each, set on the endpoint (the default group has no size)."""
    return fixed_routing_config(
        {
            role: {"endpoints": [{"address": address, "data_parallel_size": 2}], "policy": policy}
            for role, address in (("prefill", P1), ("decode", D1))
        }
    )


def held(at_rank_1: int, prompt: int = 1000) -> PickRequest:
    """A prompt of which each server's rank 1 holds the first `at_rank_1` tokens."""
    return PickRequest(
        "m",
        prompt_tokens=prompt,
        cached={D1: at_rank_1, P1: at_rank_1},
        rank_cached={D1: {1: at_rank_1}, P1: {1: at_rank_1}},
    )


def test_a_rank_is_chosen_for_its_cache_against_its_queue_and_counts_what_it_lacks() -> None:
    """kv_cache, 2 ranks each: rank 1 holds 100 of 1000 tokens (worth 200 queued tokens),
    4 requests queued there cost 256: the idle rank 0 wins and gets the whole prompt to compute;
    with 1 queued (64), rank 1 wins and gets the 900 it lacks."""
    for queued, rank, pending in ((4.0, 0, 1000), (1.0, 1, 900)):
        cfg = data_parallel("kv_cache")
        s = scheduler(cfg)
        d1, p1 = s.decode.get(D1), s.prefill.get(P1)
        assert d1 is not None and p1 is not None
        d1.rank_load, p1.rank_load = {1: queued}, {1: queued}
        with ExitStack() as inflight:
            picked = s.pick(held(100), inflight, cfg)
            assert isinstance(picked, WithPrefill)
            assert (picked.decode_counted.rank, d1.pending_tokens) == (rank, pending)
            assert (picked.prefill_counted.rank, p1.pending_tokens) == (rank, pending)


def test_only_kv_cache_chooses_a_rank_for_its_cache_and_never_on_a_server_without_ranks() -> None:
    cfg = data_parallel("least_request")
    s = scheduler(cfg)
    with ExitStack() as inflight:
        picked = s.pick(held(100), inflight, cfg)  # rank 1 holds some: the least loaded, 0
        assert isinstance(picked, WithPrefill) and picked.decode_counted.rank == 0
    cfg = config(decode={"endpoints": [D1], "policy": "kv_cache"})
    s = scheduler(cfg)
    request = PickRequest("m", prompt_tokens=1000, cached={D1: 500}, rank_cached={D1: {0: 500}})
    with ExitStack() as inflight:
        picked = s.pick(request, inflight, cfg)
        d1 = s.decode.get(D1)
        assert picked.decode_counted.rank is None and d1 is not None and d1.pending_tokens == 500


def test_a_fully_cached_prompt_brings_no_pending_tokens() -> None:
    cfg = config()
    s = scheduler(cfg)
    request = PickRequest("m", prompt_tokens=1000, cached={D1: 1000, P1: 1000})
    with ExitStack() as inflight:
        s.pick(request, inflight, cfg)
        assert [e.pending_tokens for e in (*s.prefill, *s.decode)] == [0, 0, 0, 0]


def test_the_ranks_of_a_server_from_its_group_or_its_metrics_and_none_if_unknown() -> None:
    P3, D3, D9 = "127.0.0.1:8102", "127.0.0.1:8202", "127.0.0.1:8209"
    group = {"prefill": {"endpoints": [P3]}, "decode": {"endpoints": [D3], "data_parallel_size": 4}}
    cfg = config(models={"m": group})
    s = scheduler(cfg)
    s.set_group_members("m", Role.DECODE, [D3, D9])  # D9 discovered: its group's size
    assert s.data_parallel_size(Role.DECODE, D9) == 4
    p1 = s.prefill.get(P1)
    assert p1 is not None
    p1.rank_load = {0: 1.0, 1: 0.0}  # its /metrics shows 2 engines
    assert s.data_parallel_size(Role.PREFILL, P1) == 2
    assert s.data_parallel_size(Role.PREFILL, "127.0.0.1:9999") == 1


def test_a_pick_names_one_fallback_decode_by_default() -> None:
    cfg = config(decode={"endpoints": [D1, D2, "127.0.0.1:8202"]})
    s = scheduler(cfg)
    with ExitStack() as inflight:
        assert s.pick(LONG, inflight, cfg).decodes == [D1, D2]


def test_a_subsets_503_says_so_for_either_role() -> None:
    cfg = config()
    s = scheduler(cfg)
    with ExitStack() as inflight, pytest.raises(NoHealthyDecode) as no_decode:
        s.pick(LONG, inflight, cfg, subset=Subset.of([P1]))
    with ExitStack() as inflight, pytest.raises(NoHealthyPrefill) as no_prefill:
        s.pick(LONG, inflight, cfg, subset=Subset.of([D1]))
    for refused, role in ((no_decode, "decode"), (no_prefill, "prefill")):
        assert str(refused.value) == (
            f"503 no healthy {role} endpoint among the 1 the gateway allowed (its subset "
            "hint); retry later"
        )


def cached_tokens(metrics: Metrics, role: str) -> float | None:
    return metrics.registry.get_sample_value(
        "pd_extproc_kv_cached_prompt_tokens_total", {"role": role}
    )


def test_the_cached_tokens_are_counted_for_d_whichever_way_the_request_goes() -> None:
    request = PickRequest("m", prompt_tokens=1000, cached={D1: 300, P1: 200})
    cases = (
        ({}, "disaggregated"),
        ({"decision": {"mode": "threshold", "max_prompt_tokens": 1000}}, "decode only"),
        ({"dispatch": {"no_healthy_prefill": "decode_only"}}, "no healthy prefill"),
    )
    for sections, case in cases:
        cfg = config(**sections)
        s = scheduler(cfg)
        metrics = s._metrics
        if case == "no healthy prefill":
            for address in (P1, P2):
                s.prefill.set_healthy(address, False)
        with ExitStack() as inflight:
            s.pick(request, inflight, cfg)
        assert cached_tokens(metrics, "decode") == 300, case


def test_the_decision_weighs_what_p_holds() -> None:
    """Step costs in binary fractions (2 ms a step, 0.5 ms a token, 8 ms overhead) and D
    waiting out 7.75 ms: alone 34.75 ms for 50 tokens, through P 35 if P holds none of them
    (decode-only), 34.5 if it holds one (through P)."""
    exact = {
        "mode": "load_aware",
        "step_base_ms": 2.0,
        "prefill_per_token_ms": 0.5,
        "max_batched_tokens": 100,
        "pd_overhead_ms": 8.0,
    }
    cfg = config(decision=exact)
    for p_holds, way in ((0, DecodeAlone), (1, WithPrefill), (50, WithPrefill)):
        s = scheduler(cfg)
        d1 = s.decode.get(D1)
        assert d1 is not None
        d1.waiting = 3.875
        cached = {P1: p_holds} if p_holds else {}
        with ExitStack() as inflight:
            request = PickRequest("m", prompt_tokens=50, cached=cached)
            assert isinstance(s.pick(request, inflight, cfg), way), p_holds


def test_a_pools_policy_options_reach_its_picker() -> None:
    """kv_cache weighing cached tokens at 0: D1's whole prompt cached no longer outweighs the
    one request it has in flight."""
    request = PickRequest("m", prompt_tokens=1000, cached={D1: 1000})
    for weight, chosen in ((2.0, D1), (0.0, D2)):
        decode = {"endpoints": [D1, D2], "policy": "kv_cache", "kv_cached_token_weight": weight}
        cfg = config(decode=decode)
        s = scheduler(cfg)
        d1 = s.decode.get(D1)
        assert d1 is not None
        d1.in_flight = 1
        with ExitStack() as inflight:
            assert s.pick(request, inflight, cfg).decodes[0] == chosen


def test_a_second_request_does_not_queue_behind_the_first_computing_their_prefix() -> None:
    """Two requests of one new 1000-token prompt at once: the index credits the first's P and
    D with it as soon as they schedule it, but they are still computing (or taking in) it
    for the first, so the second would wait there as long as computing it anew: the other,
    idle, P and D (a light load: an engine idle, one request in flight there). Once the
    first's legs ended there, the prompt is settled and draws the next ones."""
    kv = {"policy": "kv_cache"}
    cfg = config(prefill={"endpoints": [P1, P2], **kv}, decode={"endpoints": [D1, D2], **kv})
    s = scheduler(cfg)
    with ExitStack() as first_legs:
        first = s.pick(
            PickRequest("m", prefix=b"sys", prompt_tokens=1000, cached={}), first_legs, cfg
        )
        assert isinstance(first, WithPrefill)
        p, d = first.prefill, first.decodes[0]
        held = {p: 1000, d: 1000}
        with ExitStack() as inflight:
            second = s.pick(
                PickRequest("m", prefix=b"sys", prompt_tokens=1000, cached=held), inflight, cfg
            )
            assert isinstance(second, WithPrefill)
            assert second.prefill != p and second.decodes[0] != d
    # Settled, it is worth 2 x 1000 tokens, against the 1500 the first of two longer prompts
    # brings (and 64): the second follows it; counted once it would not (1000 < 1564).
    longer = PickRequest("m", prefix=b"sys", prompt_tokens=2500, cached=held)
    with ExitStack() as inflight:
        for _ in range(2):
            again = s.pick(longer, inflight, cfg)
            assert isinstance(again, WithPrefill)
            assert (again.prefill, again.decodes[0]) == (p, d)
