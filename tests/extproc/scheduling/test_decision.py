"""The decode-only decision and admission control as pure functions."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from extproc.config import AdmissionConfig, AdmissionLimits, DecisionConfig
from extproc.engines.load import EngineLoad
from extproc.engines.scraper import parse_families
from extproc.metrics import Metrics
from extproc.policies import LeastTokensPicker, PickRequest
from extproc.roles import Role
from extproc.scheduling.admission import role_saturation, saturation
from extproc.scheduling.decision import (
    Decider,
    Decision,
    Sides,
    decide,
    estimate_tokens,
    stall_ms,
)
from extproc.scheduling.pool import EndpointState
from extproc.scheduling.shared_load import SharedLoad, table_bytes

LOAD_AWARE = DecisionConfig(mode="load_aware")
IDLE = Sides(
    running_d=0, waiting_d=0, kv_usage_d=0, pending_d_tokens=0, queued_p_tokens=0, waiting_p=0
)
BUSY_D = Sides(
    running_d=8, waiting_d=0, kv_usage_d=0.2, pending_d_tokens=0, queued_p_tokens=0, waiting_p=0
)
TWO_RUNNING = Sides(
    running_d=2, waiting_d=0, kv_usage_d=0.2, pending_d_tokens=0, queued_p_tokens=0, waiting_p=0
)


def test_tokens_are_estimated_from_bytes() -> None:
    assert estimate_tokens(4096, 4.0) == 1024
    assert estimate_tokens(1, 4.0) == 1


def test_threshold_splits_on_the_prompt_size() -> None:
    cfg = DecisionConfig(mode="threshold", max_prompt_tokens=100)
    assert decide(cfg, 100, BUSY_D, 0).reason == "short_prompt"
    assert decide(cfg, 101, IDLE, 0) == Decision(False, "long_prompt")  # a metric's label


def test_idle_engines_go_alone_for_any_prompt() -> None:
    decision = decide(LOAD_AWARE, 4000, IDLE, 0.0)  # nothing running: no stall to pay
    assert decision.decode_only and decision.reason == "faster_alone"
    assert decision.ttft_alone_ms < decision.ttft_pd_ms


def test_a_busy_decode_gets_p_d_for_a_long_prompt_and_alone_for_a_short_one() -> None:
    assert decide(LOAD_AWARE, 1024, BUSY_D, 30.0).reason == "stall_budget"  # 59 ms > 30 ms
    assert decide(LOAD_AWARE, 64, TWO_RUNNING, 30.0).decode_only  # ~4 ms stall, twice
    assert decide(LOAD_AWARE, 64, TWO_RUNNING, 1.0).reason == "stall_budget"  # bucket empty


def test_a_busy_decode_batch_gets_p_d_where_alone_saves_less_than_the_batch_pays() -> None:
    # 64 tokens: alone saves the P path's 25 ms; the stall (3.7 ms) costs 2 running
    # requests 7.4 ms, 8 of them 29.7 ms
    assert decide(LOAD_AWARE, 64, TWO_RUNNING, 30.0).reason == "faster_alone"
    assert decide(LOAD_AWARE, 64, BUSY_D, 30.0).reason == "decode_busy"
    # where P would have to compute what D holds, alone saves more than the batch pays
    assert decide(LOAD_AWARE, 2000, BUSY_D, 30.0, d_cached=1936).reason == "faster_alone"
    assert decide(LOAD_AWARE, 2000, BUSY_D, 30.0, 1936, 1936).reason == "decode_busy"


def test_a_queued_decode_and_an_idle_prefill_give_p_d() -> None:
    queued = Sides(
        0, waiting_d=20, kv_usage_d=0, pending_d_tokens=4096, queued_p_tokens=0, waiting_p=0
    )
    assert decide(LOAD_AWARE, 256, queued, 30.0).reason == "faster_pd"


def test_a_nearly_full_decode_cache_gives_p_d() -> None:
    full = Sides(0, 0, kv_usage_d=0.95, pending_d_tokens=0, queued_p_tokens=0, waiting_p=0)
    assert decide(LOAD_AWARE, 16, full, 30.0).reason == "kv_pressure"


def test_stall_counts_every_chunk_of_a_long_prompt() -> None:
    assert stall_ms(LOAD_AWARE, 1000, 0) == 0
    assert stall_ms(LOAD_AWARE, 4096, 1) == pytest.approx(4096 * 0.058 + 10.0)


@dataclass
class Load:
    in_flight: int = 1
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    queued_tokens: int = 0
    pending_tokens: int = 0
    foreign: float = 0.0
    peer_in_flight: int = 0
    peer_pending_tokens: int = 0
    peer_queued_tokens: int = 0
    peer_alone_tokens: int = 0
    peer_stall_credit_ms: float = 0.0
    peer_stall_at: float = 0.0


# The bucket these tests empty: 30 ms, refilled at 0.3 ms per output token.
BUCKET_30 = LOAD_AWARE.model_copy(
    update={"bytes_per_token": 1.0, "max_stall_ms": 30.0, "stall_budget_ms_per_token": 0.3}
)


def test_the_stall_bucket_empties_and_counts_decisions() -> None:
    metrics = Metrics()
    decider = Decider(metrics)
    cfg = BUCKET_30
    busy = Load(in_flight=2)  # one running besides this request
    made = [decider.decide(cfg, 200, "d", busy, Load()).reason for _ in range(3)]
    assert made == ["faster_alone", "faster_alone", "stall_budget"]  # 11.6 ms each, 30 ms bucket
    text = metrics.render().decode()
    assert (
        'pd_extproc_dispatch_decisions_total{decision="decode_only",reason="faster_alone"} 2.0'
        in text
    )


def test_the_stall_bucket_refills_by_the_deciders_clock() -> None:
    now = [0.0]
    decider = Decider(Metrics(), clock=lambda: now[0])
    cfg = BUCKET_30
    busy = Load(in_flight=2)
    made = [decider.decide(cfg, 200, "d", busy, Load()).reason for _ in range(3)]
    assert made[-1] == "stall_budget"  # emptied, as above
    now[0] = 60.0  # a minute later by its clock, however little time passed here
    assert decider.decide(cfg, 200, "d", busy, Load()).reason == "faster_alone"


def test_the_sidecars_processes_carry_on_from_the_latest_stall_bucket_told() -> None:
    """One bucket per D for the sidecar: a process carries on from where another left it
    later than itself (that one's spending included), and keeps its own when that is the
    latest; a new one starts from the others'."""
    now = [1.0]
    decider = Decider(Metrics(), clock=lambda: now[0])

    def reason(credit_ms: float = 0.0, at: float = 0.0) -> str:
        d = Load(in_flight=2, peer_stall_credit_ms=credit_ms, peer_stall_at=at)  # 11.6 ms a stall
        return decider.decide(BUCKET_30, 200, "d", d, Load()).reason

    assert decider.bucket("d") == (0.0, 0.0)  # none yet: nothing to tell the others
    assert reason(5.0, at=1.0) == "stall_budget"  # new here: from the others' 5 ms
    now[0] = 2.0  # a second of refill: full again
    assert reason(5.0, at=1.0) == "faster_alone"  # theirs no later than its own: not taken
    assert decider.bucket("d") == (pytest.approx(30.0 - 11.6), 2.0)
    now[0] = 3.0
    assert reason(5.0, at=2.9) == "stall_budget"  # theirs is later: 5 ms + 0.1 s's 3 ms
    assert decider.bucket("d") == (pytest.approx(5.0 + 100 / 10.02 * 0.3), 3.0)
    assert reason(30.0, at=2.95) == "stall_budget"  # older than its own: not taken
    assert reason(30.0, at=3.0) == "stall_budget"  # told at the same instant: its own kept
    # told after this one read its clock (another process, a moment later): no refill
    assert reason(20.0, at=3.5) == "faster_alone"


def test_a_prompt_of_no_known_size_leaves_no_bucket_to_tell() -> None:
    decider = Decider(Metrics())
    assert not decider.decide(LOAD_AWARE, None, "d", Load(), Load()).decode_only
    assert decider.bucket("d") == (0.0, 0.0)


def test_the_default_budget_keeps_one_stall_under_a_tenth_of_a_short_answer() -> None:
    """By default at most 10 ms at once (and 0.15 ms per output token, 1.5 % of a 10 ms step):
    the 200-token prompt above (an 11.6 ms stall) may not prefill alone on a busy D, 160
    tokens (9.3 ms) may. 30 ms at once gave short answers caught by one stall a TPOT p99 up
    to 1.09 x round robin's on the lab's matrix."""
    decider = Decider(Metrics())
    cfg = LOAD_AWARE.model_copy(update={"bytes_per_token": 1.0})
    busy = Load(in_flight=2)  # one running besides this request
    assert decider.decide(cfg, 200, "d", busy, Load()).reason == "stall_budget"
    assert decider.decide(cfg, 160, "d", busy, Load()).reason == "faster_alone"


ADMISSION = AdmissionConfig(
    enabled=True, decode=AdmissionLimits(max_in_flight=4, max_waiting=8, max_kv_usage=0.8)
)


def test_saturation_is_the_highest_ratio_and_a_role_its_least_saturated_member() -> None:
    limits = ADMISSION.decode
    assert saturation(Load(in_flight=1, waiting=6, kv_usage=0.4), limits) == 0.75
    assert saturation(Load(in_flight=0, kv_usage=0.8), limits) == 1.0
    assert role_saturation([Load(in_flight=4), Load(in_flight=2)], limits) == 0.5
    assert saturation(Load(in_flight=99), AdmissionLimits()) == 0.0  # no limit set


def test_least_tokens_picks_the_prefill_with_the_fewest_queued_tokens() -> None:
    picker = LeastTokensPicker()
    long_queue, short_queue = EndpointState("p1", queued_tokens=4096), EndpointState("p2")
    short_queue.in_flight = 3  # more requests, fewer tokens: tokens decide
    assert picker.pick([long_queue, short_queue], PickRequest()) is short_queue
    idle = [EndpointState("p1"), EndpointState("p2")]
    assert {picker.pick(idle, PickRequest()).address for _ in range(2)} == {"p1", "p2"}


def test_d_counts_ours_exactly_and_others_as_last_scraped() -> None:
    state = EndpointState("d")
    state.in_flight = 2
    page = "vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"
    EngineLoad(lambda address: state).consume("d", parse_families(page))
    assert state.foreign == 2  # 4 at the engine, 2 of them ours
    decider = Decider(Metrics())
    alone = Load(in_flight=1)  # only this request of ours, and nothing foreign
    assert decider.decide(LOAD_AWARE, 4096, "d", alone, Load()).decode_only
    others = Load(in_flight=1, foreign=2)  # another router's requests run there
    assert decider.decide(LOAD_AWARE, 4096, "d2", others, Load()).reason == "stall_budget"


def test_a_prompt_of_no_known_size_is_never_decode_only_and_counted() -> None:
    metrics = Metrics()
    decider = Decider(metrics)
    idle = Load(in_flight=1)
    assert decider.decide(LOAD_AWARE, 40, "d", idle, Load()).decode_only  # idle: alone wins
    decision = decider.decide(LOAD_AWARE, None, "d", idle, Load())
    assert (decision.decode_only, decision.reason) == (False, "unbounded_prompt")
    text = metrics.render().decode()
    assert 'decision="disaggregate",reason="unbounded_prompt"} 1.0' in text


def test_the_tokenizers_count_and_the_members_it_did_not_render_add_up() -> None:
    threshold = DecisionConfig(mode="threshold", max_prompt_tokens=100)
    decider = Decider(Metrics())
    # 90 tokens counted, and 80 bytes (20 tokens) of documents the tokenizer did not render
    assert decider.decide(threshold, 0, "d", Load(), Load(), prompt_tokens=90).decode_only
    assert not decider.decide(threshold, 80, "d", Load(), Load(), prompt_tokens=90).decode_only


def test_a_cached_turn_spends_only_the_stall_of_what_d_lacks() -> None:
    # D holds 800 of the 1000 tokens: each turn stalls D's running request for 200 tokens'
    # prefill (11.6 ms of the 30 ms bucket), not the whole prompt's (58 ms): two turns fit
    decider = Decider(Metrics())
    cfg = BUCKET_30
    busy = Load(in_flight=2)  # one running besides this request
    made = [
        decider.decide(cfg, 0, "d", busy, Load(), prompt_tokens=1000, d_cached=800).reason
        for _ in range(3)
    ]
    assert made == ["faster_alone", "faster_alone", "stall_budget"]


def test_the_engines_load_beyond_this_sidecars_processes_is_foreign() -> None:
    """4 at the engine: 1 of this process's, 2 of its other processes' (their table), so
    only 1 was sent by another router."""
    table = bytearray(table_bytes(2))
    mine, other = (SharedLoad(table, 2, row, time.monotonic) for row in (0, 1))
    state = EndpointState("d", role=Role.DECODE, shared=mine)
    state.in_flight = 1
    other.publish(Role.DECODE, "d", 2, 0, 0)
    page = "vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"
    EngineLoad(lambda address: state).consume("d", parse_families(page))
    assert (state.peer_in_flight, state.foreign) == (2, 1)
    decider = Decider(Metrics())
    # D runs 1 + 2 + 1 others besides this request: its stall counts them all
    assert decider.decide(LOAD_AWARE, 4096, "d", state, Load()).reason == "stall_budget"
    assert Decider(Metrics()).decide(LOAD_AWARE, 4096, "d", Load(), Load()).decode_only


def test_prompts_the_other_processes_sent_d_to_prefill_alone_wait_ahead_of_this_one() -> None:
    """D idle but for a 2000-token prompt another process of the sidecar sent it to prefill
    alone (their table): alone, this one would wait for both (242 ms against 141 through P)."""
    told = Load(peer_alone_tokens=2000)
    decision = Decider(Metrics()).decide(LOAD_AWARE, 8000, "d", told, Load())
    assert decision.reason == "faster_pd"
    assert Decider(Metrics()).decide(LOAD_AWARE, 8000, "d", Load(), Load()).decode_only


# Step costs in exact binary fractions, so the expected times below are exact.
EXACT = DecisionConfig(
    mode="load_aware",
    bytes_per_token=1.0,
    step_base_ms=2.0,
    prefill_per_token_ms=0.5,
    decode_per_seq_ms=0.25,
    max_batched_tokens=100,
    pd_overhead_ms=8.0,
    max_stall_ms=60.0,
    max_kv_usage=0.5,
)


def sides(
    running: float = 0, waiting: float = 0, kv: float = 0, pending: int = 0, queued_p: int = 0
) -> Sides:
    return Sides(running, waiting, kv, pending, queued_p, waiting_p=0)


@pytest.mark.parametrize(
    ("tokens", "load", "credit", "cached", "expected"),
    [
        # alone: 3 queued steps (6) + prefill of 10 pending + 20 uncached (2 + 15) + one decode
        # step of 1 running (0.25); P: 30 queued + 0.5 × 120 waiting + 80 uncached (4 + 85)
        # + 8 + 0.25; stall 10 ms, once
        (
            120,
            Sides(1, 3, 0.25, 10, 30, 0.5),
            60.0,
            (100, 40),
            Decision(True, "faster_alone", 23.25, 97.25),
        ),
        # D at max_kv_usage exactly; both sides prefill 100 tokens (2 + 50)
        (100, sides(kv=0.5), 60.0, (0, 0), Decision(False, "kv_pressure", 52.0, 60.0)),
        (100, sides(waiting=10), 60.0, (0, 0), Decision(False, "faster_pd", 72.0, 60.0)),
        # a stall of exactly max_stall_ms (58 + one extra step) fits; half a ms less credit not
        (
            116,
            Sides(1, 0, 0, 0, 0, 2),
            60.0,
            (0, 0),
            Decision(True, "faster_alone", 62.25, 190.25),
        ),
        (
            116,
            Sides(1, 0, 0, 0, 0, 2),
            59.5,
            (0, 0),
            Decision(False, "stall_budget", 62.25, 190.25),
        ),
        # two running each wait the 20 ms stall: exactly what alone saves (64.5 - 24.5)
        (
            40,
            sides(running=2, waiting=1, queued_p=64),
            60.0,
            (0, 0),
            Decision(False, "decode_busy", 24.5, 64.5),
        ),
        # all of it held on both sides: one step each, no token computed
        (100, sides(), 60.0, (120, 120), Decision(True, "faster_alone", 2.0, 10.0)),
    ],
)
def test_each_reason_with_the_times_it_compared(
    tokens: int, load: Sides, credit: float, cached: tuple[int, int], expected: Decision
) -> None:
    d_cached, p_cached = cached
    if cached == (0, 0):  # the defaults: nothing held
        assert decide(EXACT, tokens, load, credit) == expected
    else:
        assert decide(EXACT, tokens, load, credit, d_cached, p_cached) == expected


def test_the_decider_counts_prompt_tokens_and_cached_ones_exactly() -> None:
    threshold = DecisionConfig(mode="threshold", max_prompt_tokens=100, bytes_per_token=4.0)
    decider = Decider(Metrics())
    assert decider.decide(threshold, 400, "d", Load(), Load()).decode_only  # 100 tokens
    assert not decider.decide(threshold, 404, "d", Load(), Load()).decode_only  # 101
    # the decider hands P's cached tokens on: P computes 60 of 100 (2 + 30, + 8)
    decision = Decider(Metrics()).decide(EXACT, 0, "d", Load(), Load(), 100, 0, 40)
    assert (decision.ttft_alone_ms, decision.ttft_pd_ms) == (52.0, 40.0)
    assert Decider(Metrics()).decide(EXACT, 100, "d", Load(), Load()).ttft_pd_ms == 60.0


def test_a_decode_only_prompt_is_pending_on_d_until_its_expected_first_token() -> None:
    now = [0.0]
    decider = Decider(Metrics(), clock=lambda: now[0])
    first = decider.decide(EXACT, 0, "d", Load(), Load(), prompt_tokens=20)
    assert first == Decision(True, "faster_alone", 12.0, 20.0)  # 2 + 10 alone
    # until then D has its 20 tokens to prefill before the next prompt's
    now[0] = first.ttft_alone_ms / 1e3 * 0.9995
    assert decider.decide(EXACT, 0, "d", Load(), Load(), prompt_tokens=20).ttft_alone_ms == 22.0
    now[0] = 0.0  # when the first prompt's first token is due, it no longer counts
    again = Decider(Metrics(), clock=lambda: now[0])
    again.decide(EXACT, 0, "d", Load(), Load(), prompt_tokens=20)
    now[0] = first.ttft_alone_ms / 1e3
    assert again.decide(EXACT, 0, "d", Load(), Load(), prompt_tokens=20).ttft_alone_ms == 12.0


def test_a_fully_cached_prompt_leaves_nothing_pending_on_d() -> None:
    decider = Decider(Metrics(), clock=lambda: 0.0)
    for _ in range(2):
        decision = decider.decide(EXACT, 0, "d", Load(), Load(), prompt_tokens=20, d_cached=20)
        assert decision.ttft_alone_ms == 2.0  # one step, nothing to compute, nothing queued


# D runs 2 requests besides this one (a 1 ms decode step), each output token refilling half
# a ms: 1/16 s refills 31.25 ms; stalls at a quarter ms per token, in one step.
REFILL = EXACT.model_copy(
    update={
        "step_base_ms": 0.5,
        "prefill_per_token_ms": 0.25,
        "max_batched_tokens": 1000,
        "pd_overhead_ms": 1000.0,
        "stall_budget_ms_per_token": 0.5,
    }
)


def stall_fits_after(seconds: float, in_flight: int = 3) -> bool:
    """Spend 50 of the 60 ms bucket on a D with `in_flight` requests (this one included),
    wait `seconds`, then ask for a 41.25 ms stall."""
    now = [0.0]
    decider = Decider(Metrics(), clock=lambda: now[0])
    busy = Load(in_flight=in_flight)
    assert decider.decide(REFILL, 0, "d", busy, Load(), prompt_tokens=200).decode_only
    now[0] = seconds
    return decider.decide(REFILL, 0, "d", busy, Load(), prompt_tokens=165).decode_only


def test_the_stall_bucket_refills_per_decode_step_of_d() -> None:
    assert stall_fits_after(1 / 16)  # 10 + 31.25: exactly the stall
    assert not stall_fits_after(0.06245)  # 0.025 ms short


def test_a_forgotten_decode_starts_again_with_a_full_bucket() -> None:
    decider = Decider(Metrics(), clock=lambda: 0.0)
    busy = Load(in_flight=3)
    assert decider.decide(REFILL, 0, "d", busy, Load(), prompt_tokens=200).decode_only
    assert not decider.decide(REFILL, 0, "d", busy, Load(), prompt_tokens=200).decode_only
    decider.forget("d")
    decider.forget("never-seen")
    assert decider.decide(REFILL, 0, "d", busy, Load(), prompt_tokens=200).decode_only


def test_the_stall_bucket_refills_per_decode_step_of_a_busier_d() -> None:
    """D runs 4 besides this request: a 1.5 ms step, so 93.75 ms refill 31.25 ms (half a ms
    per output token), exactly what the 41.25 ms stall lacks after 50 of 60 were spent."""
    assert stall_fits_after(0.09375, in_flight=5)
    assert not stall_fits_after(0.0937, in_flight=5)


def test_nothing_is_alone_on_a_decode_before_or_after_its_prompts_are_due() -> None:
    now = [0.0]
    decider = Decider(Metrics(), clock=lambda: now[0])
    assert decider.alone("d") == (0, 0.0)
    first = decider.decide(EXACT, 0, "d", Load(), Load(), prompt_tokens=20)
    assert decider.alone("d") == (20, first.ttft_alone_ms / 1e3)
    now[0] = 1.0
    decider.decide(EXACT, 0, "d", Load(kv_usage=1.0), Load(), prompt_tokens=20)  # via P
    assert decider.alone("d") == (0, 0.0)


def test_the_prefill_queue_of_the_sidecars_other_processes_counts_as_this_ones() -> None:
    # P computes 50 + 50 queued ahead, then this prompt's 100: 2 steps (4) + 100, + 8
    mine = Decider(Metrics()).decide(EXACT, 0, "d", Load(), Load(queued_tokens=100), 100)
    shared = Load(queued_tokens=50, peer_queued_tokens=50)
    assert Decider(Metrics()).decide(EXACT, 0, "d", Load(), shared, 100).ttft_pd_ms == 112.0
    assert mine.ttft_pd_ms == 112.0
