"""P's identity: what is accepted from P's kv_transfer_params, the cache's life cycle, and the
strategy each identity allows."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.config import DispatchMode
from extproc.protocol.identity import (
    IdentityCache,
    PrefillIdentity,
    identity_from_params,
    of_where,
    where,
)
from extproc.request.plan import Strategy, choose_strategy

P_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "e1",
    "remote_request_id": "cmpl-x-0-12345678",
    "remote_host": "10.0.0.11",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 20,
    "transfer_mode": "push",
    "remote_prefill_cached_tokens": 0,
}


def test_identity_from_p_response() -> None:
    identity = identity_from_params(P_PARAMS)
    params = identity.decode_params("rid", "xfer-1")
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e1",
        "remote_host": "10.0.0.11",
        "remote_port": 5600,
        "tp_size": 1,
        "pp_size": 1,
        "dcp_size": 1,
        "remote_request_id": "rid",
        "transfer_id": "xfer-1",
    }


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_port": "5600"}, "remote_port"),
        ({"remote_host": "evil host/x"}, "remote_host"),
        ({"remote_host": None}, "remote_host"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"tp_size": 0}, "tp_size"),
        ({"transfer_mode": "teleport"}, "transfer_mode"),
    ],
)
def test_invalid_identities_are_refused(change: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        identity_from_params(P_PARAMS | change)


def test_none_params_explain_the_likely_cause() -> None:
    with pytest.raises(ValueError, match="KV connector"):
        identity_from_params(None)


def test_old_vllm_without_pp_and_mode_is_accepted() -> None:
    old = {k: v for k, v in P_PARAMS.items() if k not in ("pp_size", "dcp_size", "transfer_mode")}
    identity = identity_from_params(old)
    assert (identity.pp_size, identity.transfer_mode) == (1, None)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_cache_learns_refreshes_changes_and_drops() -> None:
    events: list[str] = []
    clock = FakeClock()
    cache = IdentityCache(2, 60, 300, on_event=lambda ep, ev: events.append(ev), clock=clock)
    first = identity_from_params(P_PARAMS)
    second = identity_from_params(P_PARAMS | {"remote_engine_id": "e2"})
    cache.learn("p1", first)
    cache.learn("p1", first)
    cache.learn("p1", second)
    assert cache.get("p1") == second
    assert not cache.drop("p1", only_if=first)  # someone already replaced it
    assert cache.drop("p1")
    assert cache.get("p1") is None
    assert events == ["learned", "refreshed", "changed", "dropped"]
    cache.learn("p1", first)  # a different engine seen across a drop is still a change
    cache.drop("p1")
    cache.learn("p1", first)  # the same engine again after a drop is only re-learned
    assert events[4:] == ["changed", "flapping", "dropped", "learned"]  # 2 changes in 60 s


def test_flapping_endpoint_becomes_serial_for_the_cooldown() -> None:
    events: list[str] = []
    clock = FakeClock()
    cache = IdentityCache(2, 60, 300, on_event=lambda ep, ev: events.append(ev), clock=clock)
    a = identity_from_params(P_PARAMS)
    b = identity_from_params(P_PARAMS | {"remote_engine_id": "dp1"})
    cache.learn("p", a)
    cache.learn("p", b)
    assert not cache.serial_only("p")
    clock.now = 10
    cache.learn("p", a)
    assert cache.serial_only("p") and "flapping" in events
    clock.now = 311
    assert not cache.serial_only("p")


PUSH = identity_from_params(P_PARAMS)
PULL = identity_from_params(P_PARAMS | {"transfer_mode": "pull"})
PRE_0_28 = identity_from_params({k: v for k, v in P_PARAMS.items() if k != "transfer_mode"})


@pytest.mark.parametrize(
    ("mode", "identity", "serial_only", "expected"),
    [
        (DispatchMode.AUTO, PUSH, False, (Strategy.PARALLEL, "cache_hit")),
        (DispatchMode.AUTO, None, False, (Strategy.SERIAL, "cache_miss")),
        (DispatchMode.AUTO, PULL, False, (Strategy.SERIAL, "pull")),
        (DispatchMode.AUTO, PRE_0_28, False, (Strategy.SERIAL, "pull")),  # vLLM < 0.28: pull
        (DispatchMode.AUTO, PUSH, True, (Strategy.SERIAL, "serial_only")),
        (DispatchMode.PUSH, PULL, False, (Strategy.PARALLEL, "cache_hit")),
        (DispatchMode.PUSH, None, False, (Strategy.SERIAL, "cache_miss")),
        (DispatchMode.PULL, PUSH, False, (Strategy.SERIAL, "pull")),
        (DispatchMode.SERIAL_PUSH, PUSH, False, (Strategy.SERIAL, "serial_only")),
    ],
    ids=lambda v: str(v) if not hasattr(v, "engine_id") else str(v.transfer_mode),
)
def test_strategy_table(mode, identity, serial_only, expected) -> None:
    assert choose_strategy(mode, identity, serial_only) == expected


PARAMS: dict[str, Any] = {
    "remote_engine_id": "e1",
    "remote_host": "10.0.0.11",
    "remote_port": 5600,
    "tp_size": 2,
    "pp_size": 3,
    "dcp_size": 4,
    "transfer_mode": "push",
}


def refused(change: dict[str, Any], drop: tuple[str, ...] = ()) -> str:
    params = {k: v for k, v in (PARAMS | change).items() if k not in drop}
    with pytest.raises(ValueError) as caught:
        identity_from_params(params)
    return str(caught.value)


def test_every_field_is_taken_from_p() -> None:
    assert identity_from_params(PARAMS) == PrefillIdentity(
        engine_id="e1",
        host="10.0.0.11",
        port=5600,
        tp_size=2,
        pp_size=3,
        dcp_size=4,
        transfer_mode="push",
    )


@pytest.mark.parametrize(
    "host",
    [
        "10.0.0.11",
        "::1",
        "fe80::1",
        "prefill-0.pd.svc.cluster.local",
        "p",
        "a" * 63 + ".b",
        ".".join(["abcdefghi"] * 25) + ".abc",
    ],  # 253 characters: the longest DNS name
)
def test_hosts_accepted(host: str) -> None:
    assert identity_from_params(PARAMS | {"remote_host": host}).host == host


@pytest.mark.parametrize(
    ("host", "message"),
    [
        (None, "remote_host must be a host name or IP (got None)"),
        ("", "remote_host must be a host name or IP (got '')"),
        (7, "remote_host must be a host name or IP (got 7)"),
        ("a" * 254, f"remote_host must be a host name or IP (got {'a' * 254!r})"),
        ("evil host", "remote_host is not a valid host name (got 'evil host')"),
        ("a..b", "remote_host is not a valid host name (got 'a..b')"),
        ("p.", "remote_host is not a valid host name (got 'p.')"),
        ("p_1", "remote_host is not a valid host name (got 'p_1')"),
        ("10.0.0.1/8", "remote_host is not a valid host name (got '10.0.0.1/8')"),
    ],
)
def test_hosts_refused(host: Any, message: str) -> None:
    assert refused({"remote_host": host}) == message


@pytest.mark.parametrize("port", [1, 5600, 65535])
def test_ports_accepted(port: int) -> None:
    assert identity_from_params(PARAMS | {"remote_port": port}).port == port


@pytest.mark.parametrize("port", [0, 65536, -1, True, "5600", None])
def test_ports_refused(port: Any) -> None:
    assert refused({"remote_port": port}) == f"remote_port must be 1-65535 (got {port!r})"


def test_engine_id_bounds() -> None:
    assert identity_from_params(PARAMS | {"remote_engine_id": "e" * 256}).engine_id == "e" * 256
    for bad in ["", "e" * 257, 7, None]:
        message = f"remote_engine_id must be a non-empty string (got {bad!r})"
        assert refused({"remote_engine_id": bad}) == message


@pytest.mark.parametrize("key", ["tp_size", "pp_size", "dcp_size"])
@pytest.mark.parametrize("value", [0, -1, True, 1.0, "2"])
def test_parallel_sizes_must_be_positive_integers(key: str, value: Any) -> None:
    assert refused({key: value}) == f"{key} must be a positive integer (got {value!r})"


def test_tp_size_is_required_pp_and_dcp_default_to_one() -> None:
    assert refused({}, drop=("tp_size",)) == "tp_size must be a positive integer (got None)"
    assert refused({"tp_size": None}) == "tp_size must be a positive integer (got None)"
    older = {k: v for k, v in PARAMS.items() if k not in ("pp_size", "dcp_size")}
    for params in (older, PARAMS | {"pp_size": None, "dcp_size": None}):
        identity = identity_from_params(params)
        assert (identity.pp_size, identity.dcp_size) == (1, 1)


@pytest.mark.parametrize("mode", ["push", "pull", None])
def test_transfer_modes(mode: str | None) -> None:
    assert identity_from_params(PARAMS | {"transfer_mode": mode}).transfer_mode == mode


def test_unknown_transfer_mode_is_refused() -> None:
    message = "transfer_mode must be 'push' or 'pull' (got 'PUSH')"
    assert refused({"transfer_mode": "PUSH"}) == message


@pytest.mark.parametrize("params", [None, [("remote_engine_id", "e1")], "e1"])
def test_no_mapping_is_refused(params: Any) -> None:
    with pytest.raises(ValueError) as caught:
        identity_from_params(params)
    assert str(caught.value) == (
        "P returned no kv_transfer_params (is it started with a KV connector?)"
    )


# ---- the cache ----------------------------------------------------------------------------

E1 = identity_from_params(PARAMS)
E2 = identity_from_params(PARAMS | {"remote_engine_id": "e2"})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_cache(threshold: int = 3, window: float = 60, cooldown: float = 300):
    events: list[tuple[str, str]] = []
    clock = Clock()
    cache = IdentityCache(threshold, window, cooldown, lambda e, ev: events.append((e, ev)), clock)
    return cache, events, clock


def test_unknown_endpoint() -> None:
    cache, events, _ = make_cache()
    assert cache.get("p") is None
    assert not cache.serial_only("p")
    assert not cache.drop("p")
    assert cache.snapshot() == {}
    assert events == []


def test_events_name_the_endpoint_and_endpoints_are_separate() -> None:
    cache, events, _ = make_cache()
    cache.learn("p1", E1)
    cache.learn("p2", E2)
    cache.learn("p1", E1)
    assert (cache.get("p1"), cache.get("p2")) == (E1, E2)
    assert events == [("p1", "learned"), ("p2", "learned"), ("p1", "refreshed")]


def test_changes_and_flapping_name_the_endpoint() -> None:
    cache, events, _ = make_cache(threshold=2)
    cache.learn("p0", E2)
    cache.learn("p1", E1)
    cache.learn("p1", E2)
    cache.learn("p1", E1)
    assert events[2:] == [("p1", "changed"), ("p1", "changed"), ("p1", "flapping")]
    assert cache.serial_only("p1") and not cache.serial_only("p0")


def test_drop_only_if_the_identity_is_still_the_one_given() -> None:
    cache, events, _ = make_cache()
    cache.learn("p", E1)
    assert not cache.drop("p", only_if=E2)
    assert cache.get("p") == E1
    assert cache.drop("p", only_if=E1)
    assert not cache.drop("p")  # already dropped: nothing to report
    assert events == [("p", "learned"), ("p", "dropped")]


def test_forget_also_forgets_the_last_engine_seen() -> None:
    cache, events, _ = make_cache()
    cache.learn("p", E1)
    cache.forget("p")
    cache.forget("p")  # twice is harmless
    assert cache.get("p") is None and cache.snapshot() == {}
    cache.learn("p", E2)  # a new member: learned, not a change
    assert events == [("p", "learned"), ("p", "learned")]


def test_changes_flap_only_within_the_window() -> None:
    cache, events, clock = make_cache(threshold=3, window=60)
    start = clock.now
    cache.learn("p", E1)
    cache.learn("p", E2)  # first change
    clock.now = start + 30
    cache.learn("p", E1)  # second
    clock.now = start + 60.5
    cache.learn("p", E2)  # third, but the first has left the window: two within 60 s
    assert not cache.serial_only("p")
    clock.now = start + 89
    cache.learn("p", E1)  # three within 60 s
    assert cache.serial_only("p")
    assert [ev for _, ev in events].count("flapping") == 1


def test_a_change_at_the_window_edge_still_counts() -> None:
    cache, _, clock = make_cache(threshold=2, window=60)
    cache.learn("p", E1)
    cache.learn("p", E2)
    clock.now += 60  # exactly the window: still inside it
    cache.learn("p", E1)
    assert cache.serial_only("p")


def test_cooldown_ends_exactly_after_its_length_and_counting_restarts() -> None:
    cache, events, clock = make_cache(threshold=2, window=60, cooldown=300)
    cache.learn("p", E1)
    cache.learn("p", E2)
    cache.learn("p", E1)
    assert [ev for _, ev in events] == ["learned", "changed", "changed", "flapping"]
    start = clock.now
    clock.now = start + 299.9
    assert cache.serial_only("p") and cache.snapshot()["p"]["serial_only"]
    clock.now = start + 300
    assert not cache.serial_only("p") and not cache.snapshot()["p"]["serial_only"]
    cache.learn("p", E2)  # the count started again after flapping: one change is not two
    assert not cache.serial_only("p")


def test_threshold_of_one_flaps_on_the_first_change() -> None:
    cache, _, _ = make_cache(threshold=1)
    cache.learn("p", E1)
    assert not cache.serial_only("p")
    cache.learn("p", E2)
    assert cache.serial_only("p")


def test_snapshot_shows_what_is_known() -> None:
    cache, _, _ = make_cache()
    pull = identity_from_params(PARAMS | {"remote_engine_id": "e9", "transfer_mode": "pull"})
    cache.learn("p1", E1)
    cache.learn("p2", pull)
    cache.learn("p3", E2)
    cache.drop("p3")
    assert cache.snapshot() == {
        "p1": {"engine_id": "e1", "transfer_mode": "push", "serial_only": False},
        "p2": {"engine_id": "e9", "transfer_mode": "pull", "serial_only": False},
        "p3": {"engine_id": None, "transfer_mode": None, "serial_only": False},
    }


def test_data_parallel_ranks_are_separate_engines_that_never_flap() -> None:
    """One server with two ranks: each rank keeps its own identity, so answers alternating
    between them are refreshes, never changes (without ranks: a change per answer, then a
    serial cool-down)."""
    cache, events, _ = make_cache(threshold=2)
    for _ in range(3):
        cache.learn("p", E1, rank=0)
        cache.learn("p", E2, rank=1)
    assert (cache.get("p", 0), cache.get("p", 1), cache.get("p")) == (E1, E2, None)
    assert not cache.serial_only("p", 0) and not cache.serial_only("p", 1)
    assert {event for _, event in events} == {"learned", "refreshed"}
    assert events[:2] == [("p dp0", "learned"), ("p dp1", "learned")]
    assert cache.missing("p", 2) == [] and cache.missing("p", 3) == [2]
    assert cache.missing("q", 1) == [None] and cache.missing("q", 2) == [0, 1]
    assert set(cache.snapshot()) == {"p dp0", "p dp1"}


def test_a_ranks_drop_is_its_own_and_the_endpoints_drop_is_every_rank() -> None:
    cache, events, _ = make_cache()
    cache.learn("p", E1, rank=0)
    cache.learn("p", E2, rank=1)
    assert not cache.drop("p", only_if=E1, rank=1)  # rank 1 is not E1
    assert cache.drop("p", rank=1)
    assert (cache.get("p", 0), cache.get("p", 1)) == (E1, None)
    cache.learn("p", E2, rank=1)
    assert cache.drop("p")  # P's health check failed, or the server restarted
    assert (cache.get("p", 0), cache.get("p", 1)) == (None, None)
    assert [e for e in events if e[1] == "dropped"] == [
        ("p dp1", "dropped"),
        ("p dp0", "dropped"),
        ("p dp1", "dropped"),
    ]
    cache.learn("p", E1, rank=0)
    cache.forget("p")
    assert cache.get("p", 0) is None and cache.snapshot() == {}


def test_where_names_a_rank_and_of_where_reads_it_back() -> None:
    for endpoint, rank in (("10.0.0.1:8100", None), ("10.0.0.1:8100", 3), ("[::1]:8100", 0)):
        assert of_where(where(endpoint, rank)) == (endpoint, rank)
