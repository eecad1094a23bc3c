"""Endpoint-picking policies: the contract every policy keeps, then each policy's behaviour.

Statistical checks use fixed seeds or fixed key sets (blake2b is deterministic), so they are
exact reruns, not flaky; their bounds are still the statistical ones, with margin.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.config import ConfigError, parse_config
from extproc.policies import (
    POLICIES,
    PickRequest,
    PowerOfTwoOptions,
    PowerOfTwoPicker,
    PrefixOptions,
    PrefixPicker,
    RandomPicker,
    RoundRobinPicker,
    SessionPicker,
    build_picker,
    hrw_order,
    load_score,
)
from extproc.scheduling.pool import EndpointState, Pool


def endpoints(n: int, **loads: Sequence[float]) -> list[EndpointState]:
    """n endpoints; `loads` gives per-endpoint in_flight / waiting / kv_usage lists."""
    states = [EndpointState(f"10.0.0.{i + 1}:8000") for i in range(n)]
    for name, values in loads.items():
        for state, value in zip(states, values, strict=True):
            setattr(state, name, value)
    return states


def keys(n: int) -> list[str]:
    return [f"conversation-{i}" for i in range(n)]


# ---- the contract, for every registered policy ------------------------------------------

REQUESTS = [
    PickRequest(),
    PickRequest(model="m", session="s-1"),
    PickRequest(model="m", prefix=b'[{"role":"system","content":"You are helpful."}]'),
    PickRequest(model="m", session="s-2", prefix=b'"Once upon a time"'),
]


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("request_", REQUESTS, ids=["empty", "session", "prefix", "both"])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_returns_one_of_the_candidates(name: str, request_: PickRequest, n: int) -> None:
    picker = build_picker(name)
    candidates = endpoints(n, in_flight=[i % 3 for i in range(n)])
    for _ in range(20):
        assert picker.pick(candidates, request_) in candidates


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_never_an_unhealthy_endpoint_through_the_pool(name: str) -> None:
    addresses = [f"10.0.0.{i}:8000" for i in range(1, 6)]
    pool = Pool("decode", addresses, build_picker(name))
    for address in addresses[:3]:
        pool.set_healthy(address, False)
    for i in range(50):
        for request in [*REQUESTS, PickRequest(session=f"s{i}", prefix=f"p{i}".encode())]:
            picked = pool.pick(request)
            assert picked is not None and picked.healthy


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_healthy_endpoint_is_none(name: str) -> None:
    pool = Pool("decode", ["10.0.0.1:8000"], build_picker(name))
    pool.set_healthy("10.0.0.1:8000", False)
    assert pool.pick(PickRequest(session="s")) is None


def test_fallback_is_the_next_healthy_member_after_the_choice() -> None:
    addresses = [f"10.0.0.{i}:8000" for i in range(1, 5)]
    pool = Pool("decode", addresses, RoundRobinPicker())
    pool.set_healthy(addresses[1], False)
    picked = [[e.address for e in pool.pick_with_fallback()] for _ in range(3)]
    # healthy: 1, 3, 4; the fallback skips 2 and wraps around after 4
    assert picked == [addresses[::2], addresses[2:], [addresses[3], addresses[0]]]
    assert [e.address for e in pool.pick_with_fallback(among=addresses[:1])] == addresses[:1]


state_lists = st.integers(min_value=1, max_value=8).flatmap(
    lambda n: st.lists(
        st.builds(
            EndpointState,
            address=st.just("x"),
            in_flight=st.integers(0, 50),
            waiting=st.floats(0, 100),
            kv_usage=st.floats(0, 1),
        ),
        min_size=n,
        max_size=n,
    )
)
pick_requests = st.builds(
    PickRequest,
    model=st.text(max_size=5),
    session=st.none() | st.text(max_size=20),
    prefix=st.binary(max_size=600),
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(states=state_lists, request_=pick_requests)
def test_any_load_any_request_picks_a_candidate(
    name: str, states: list[EndpointState], request_: PickRequest
) -> None:
    for i, state in enumerate(states):
        state.address = f"10.0.0.{i}:8000"
    assert build_picker(name).pick(states, request_) in states


PREFILL, DECODE = {"endpoints": ["127.0.0.1:8100"]}, {"endpoints": ["127.0.0.1:8200"]}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_config_accepts_every_registered_policy(name: str) -> None:
    assert re.fullmatch(r"[a-z]+(_[a-z]+)*", name)  # one naming convention: snake_case
    pool = {"policy": name}
    assert parse_config({"prefill": pool | PREFILL, "decode": pool | DECODE}).prefill.policy == name


def test_config_rejects_an_unknown_policy_in_one_line() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"prefill": PREFILL | {"policy": "power-of-two"}, "decode": DECODE})
    assert str(error.value).startswith("prefill.policy: unknown policy 'power-of-two'; one of:")


def test_build_picker_passes_the_pool_options() -> None:
    config = parse_config(
        {
            "prefill": {
                "endpoints": ["127.0.0.1:8100"],
                "policy": "prefix",
                "prefix_bytes": 64,
                "prefix_load_slack": 0.5,
            },
            "decode": {
                "endpoints": ["127.0.0.1:8200"],
                "policy": "power_of_two",
                "kv_usage_weight": 0,
            },
        }
    )
    prefill = build_picker(config.prefill.policy, config.prefill.options)
    decode = build_picker(config.decode.policy, config.decode.options)
    assert isinstance(prefill, PrefixPicker) and prefill._prefix_bytes == 64
    assert prefill._load_slack == 0.5
    assert isinstance(decode, PowerOfTwoPicker) and decode._kv_usage_weight == 0


def test_options_may_be_written_flat_or_nested() -> None:
    pool = PREFILL | {"policy": "power_of_two"}
    flat = parse_config({"prefill": pool | {"kv_usage_weight": 2}, "decode": DECODE})
    nested = parse_config({"prefill": pool | {"options": {"kv_usage_weight": 2}}, "decode": DECODE})
    assert flat.prefill.options == nested.prefill.options == PowerOfTwoOptions(kv_usage_weight=2)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"kv_usage_weight": -1}, "prefill: kv_usage_weight: Input should be greater than"),
        ({"policy": "prefix", "kv_usage_weight": -1}, "prefill: kv_usage_weight: Input"),
        ({"options": {"weight": 1}}, "prefill: weight: Extra inputs are not permitted"),
    ],
)
def test_bad_policy_options_fail_at_load(keys: dict[str, object], message: str) -> None:
    pool = PREFILL | {"policy": "power_of_two"}
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        parse_config({"prefill": pool | keys, "decode": DECODE})


def test_only_the_load_weighing_policies_need_engine_load() -> None:
    needs = {name for name, policy in POLICIES.items() if policy.needs_load}
    assert needs == {"power_of_two", "kv_cache"}


# ---- round_robin and random -------------------------------------------------------------


def test_round_robin_cycles() -> None:
    candidates = endpoints(3)
    picker = RoundRobinPicker()
    assert [picker.pick(candidates, PickRequest()) for _ in range(6)] == candidates * 2


def test_random_is_roughly_uniform() -> None:
    candidates = endpoints(4)
    picker = RandomPicker(rng=random.Random(7))
    counts = Counter(picker.pick(candidates, PickRequest()).address for _ in range(4000))
    # 1000 expected each; 5 standard deviations (sqrt(4000 × 1/4 × 3/4) ≈ 27) is ±137
    assert all(abs(count - 1000) < 140 for count in counts.values()), counts


# ---- power_of_two -------------------------------------------------------------------------


def test_load_score_is_in_flight_plus_waiting_plus_weighted_kv() -> None:
    [state] = endpoints(1, in_flight=[2], waiting=[3.0], kv_usage=[0.5])
    assert load_score(state, kv_usage_weight=4.0) == 2 + 3 + 4 * 0.5


@pytest.mark.parametrize(
    ("loads", "busy"),
    [
        ({"in_flight": [0, 0, 6, 0]}, 2),  # our own requests
        ({"waiting": [0, 9, 0, 0]}, 1),  # another router's requests, queued at the engine
        ({"kv_usage": [0.1, 0.1, 0.1, 0.95]}, 3),  # a nearly full KV cache
        ({"in_flight": [1, 1, 1, 1], "waiting": [4, 0, 0, 0]}, 0),
    ],
)
def test_power_of_two_never_picks_the_busiest(loads: dict[str, list[float]], busy: int) -> None:
    """Any pair containing the busiest endpoint holds a less busy one: it is never taken."""
    candidates = endpoints(4, **loads)
    picker = PowerOfTwoPicker(rng=random.Random(1))
    picks = Counter(picker.pick(candidates, PickRequest()).address for _ in range(600))
    assert candidates[busy].address not in picks
    assert len(picks) == 3  # the others share the load


def test_power_of_two_with_two_always_takes_the_lighter() -> None:
    candidates = endpoints(2, in_flight=[3, 3], waiting=[0, 2])
    picker = PowerOfTwoPicker(rng=random.Random(3))
    assert {picker.pick(candidates, PickRequest()).address for _ in range(50)} == {
        candidates[0].address
    }


def test_power_of_two_kv_weight_zero_ignores_kv_usage() -> None:
    candidates = endpoints(2, in_flight=[1, 2], kv_usage=[1.0, 0.0])
    picker = PowerOfTwoPicker(PowerOfTwoOptions(kv_usage_weight=0), rng=random.Random(3))
    assert picker.pick(candidates, PickRequest()) is candidates[0]
    picker = PowerOfTwoPicker(PowerOfTwoOptions(kv_usage_weight=4))
    assert picker.pick(candidates, PickRequest()) is candidates[1]


def test_power_of_two_spreads_equal_endpoints() -> None:
    candidates = endpoints(3)
    picker = PowerOfTwoPicker(rng=random.Random(5))
    counts = Counter(picker.pick(candidates, PickRequest()).address for _ in range(3000))
    assert all(abs(count - 1000) < 150 for count in counts.values()), counts


# ---- session ----------------------------------------------------------------------------


def sessions_to(candidates: list[EndpointState], ids: list[str]) -> dict[str, str]:
    picker = SessionPicker()
    return {s: picker.pick(candidates, PickRequest(session=s)).address for s in ids}


def test_session_sticks_whatever_the_load() -> None:
    candidates = endpoints(4)
    picker = SessionPicker()
    first = picker.pick(candidates, PickRequest(session="abc"))
    for i in range(20):
        candidates[i % 4].in_flight += 3
        assert picker.pick(candidates, PickRequest(session="abc")) is first


def test_session_does_not_depend_on_candidate_order() -> None:
    candidates = endpoints(5)
    assert sessions_to(candidates, keys(200)) == sessions_to(candidates[::-1], keys(200))


def test_session_hash_is_stable_across_processes() -> None:
    """Pinned: Python's salted hash() would give another answer in another process."""
    order = hrw_order(b"conversation-1", endpoints(3))
    assert [s.address for s in order] == ["10.0.0.3:8000", "10.0.0.2:8000", "10.0.0.1:8000"]


def test_sessions_spread_evenly() -> None:
    counts = Counter(sessions_to(endpoints(4), keys(4000)).values())
    # 1000 expected each, binomial sd ≈ 27: ±150 is more than 5 sd
    assert all(abs(count - 1000) < 150 for count in counts.values()), counts


def test_removing_an_endpoint_moves_only_its_sessions_and_spreads_them() -> None:
    candidates = endpoints(4)
    before = sessions_to(candidates, keys(4000))
    gone = candidates[1].address
    after = sessions_to([c for c in candidates if c.address != gone], keys(4000))
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s in before if before[s] == gone}  # exactly the departed one's
    assert 0.25 - 0.04 < len(moved) / 4000 < 0.25 + 0.04
    spread = Counter(after[s] for s in moved)
    assert len(spread) == 3 and min(spread.values()) > len(moved) / 3 * 0.75, spread


def test_adding_an_endpoint_moves_about_one_in_n() -> None:
    candidates = endpoints(5)
    before = sessions_to(candidates[:4], keys(4000))
    after = sessions_to(candidates, keys(4000))
    moved = [s for s in before if before[s] != after[s]]
    assert all(after[s] == candidates[4].address for s in moved)  # only onto the new one
    assert 0.2 - 0.04 < len(moved) / 4000 < 0.2 + 0.04


def test_session_without_header_is_least_request() -> None:
    candidates = endpoints(3, in_flight=[4, 1, 2])
    picker = SessionPicker()
    assert picker.pick(candidates, PickRequest()) is candidates[1]
    assert picker.pick(candidates, PickRequest(session="")) is candidates[1]


# ---- prefix -----------------------------------------------------------------------------

SYSTEM = b'[{"role":"system","content":"' + b"You are a careful assistant. " * 12


def test_prefix_same_start_same_endpoint() -> None:
    candidates = endpoints(4)
    picker = PrefixPicker(PrefixOptions(prefix_bytes=256))
    picks = {
        picker.pick(candidates, PickRequest(prefix=SYSTEM + f"question {i}".encode())).address
        for i in range(50)
    }
    assert len(picks) == 1


def test_prefix_different_starts_spread() -> None:
    candidates = endpoints(4)
    picker = PrefixPicker(PrefixOptions(prefix_bytes=256))
    counts = Counter(
        picker.pick(candidates, PickRequest(prefix=f"doc {i}: ".encode() + SYSTEM)).address
        for i in range(2000)
    )
    assert all(abs(count - 500) < 100 for count in counts.values()), counts


def test_prefix_only_the_first_bytes_count() -> None:
    candidates = endpoints(8)
    picker = PrefixPicker(PrefixOptions(prefix_bytes=16))
    same = {
        picker.pick(candidates, PickRequest(prefix=b"0123456789abcdef" + bytes([i]) * 40))
        for i in range(40)
    }
    assert len(same) == 1


def test_prefix_spills_to_the_same_second_choice_when_overloaded() -> None:
    candidates = endpoints(4)
    request = PickRequest(prefix=SYSTEM)
    first, second = hrw_order(SYSTEM[:256], candidates)[:2]
    picker = PrefixPicker(PrefixOptions(prefix_bytes=256, prefix_load_slack=0.25))
    assert picker.pick(candidates, request) is first
    first.in_flight = 3  # others idle: bound ceil(1.25 × 4 / 4) = 2, 3 + 1 > 2
    for _ in range(5):
        assert picker.pick(candidates, request) is second


def test_prefix_keeps_affinity_under_even_load() -> None:
    candidates = endpoints(4, in_flight=[5, 5, 5, 5])
    first = hrw_order(SYSTEM[:256], candidates)[0]
    first.in_flight = 6  # bound ceil(1.25 × 22 / 4) = 7, 6 + 1 fits
    picker = PrefixPicker(PrefixOptions(prefix_load_slack=0.25))
    assert picker.pick(candidates, PickRequest(prefix=SYSTEM)) is first


@given(
    in_flight=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    prefix=st.binary(min_size=1, max_size=300),
    slack=st.floats(0, 2),
)
def test_prefix_respects_the_load_bound(in_flight: list[int], prefix: bytes, slack: float) -> None:
    candidates = endpoints(len(in_flight), in_flight=in_flight)
    picker = PrefixPicker(PrefixOptions(prefix_load_slack=slack))
    picked = picker.pick(candidates, PickRequest(prefix=prefix))
    total = sum(in_flight)
    assert picked.in_flight + 1 <= -(-(1 + slack) * (total + 1) // len(candidates))


def test_prefix_without_prompt_is_least_request() -> None:
    candidates = endpoints(3, in_flight=[4, 1, 2])
    assert PrefixPicker().pick(candidates, PickRequest()) is candidates[1]


@pytest.mark.parametrize("policy", ["least_request", "power_of_two", "least_tokens", "prefix"])
def test_the_load_policies_count_the_sidecars_other_processes_requests(policy: str) -> None:
    """Each of two endpoints is where the policy would go alone (prefix: the request's
    rendezvous first); the sidecar's other ext_proc processes have 5 requests (and their P
    legs' tokens) in flight at it: the policy takes the other."""
    for first in range(2):
        a, b = EndpointState("10.0.0.1:8000"), EndpointState("10.0.0.2:8000")
        wanted = PickRequest(prefix=b"k" * first + b"prompt")
        busy = build_picker(policy).pick([a, b], wanted)
        busy.peer_in_flight, busy.peer_queued_tokens = 5, 1000
        assert build_picker(policy).pick([a, b], wanted) is (b if busy is a else a)
