from __future__ import annotations

import pytest

from extproc.config import DispatchMode
from extproc.protocol.identity import IdentityCache, identity_from_params
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


@pytest.mark.parametrize(
    ("mode", "identity", "serial_only", "expected"),
    [
        (DispatchMode.AUTO, PUSH, False, (Strategy.PARALLEL, "cache_hit")),
        (DispatchMode.AUTO, None, False, (Strategy.SERIAL, "cache_miss")),
        (DispatchMode.AUTO, PULL, False, (Strategy.SERIAL, "pull")),
        (DispatchMode.AUTO, PUSH, True, (Strategy.SERIAL, "serial_only")),
        (DispatchMode.PUSH, PULL, False, (Strategy.PARALLEL, "cache_hit")),
        (DispatchMode.PUSH, None, False, (Strategy.SERIAL, "cache_miss")),
        (DispatchMode.PULL, PUSH, False, (Strategy.SERIAL, "pull")),
        (DispatchMode.SERIAL_PUSH, PUSH, False, (Strategy.SERIAL, "serial_only")),
    ],
    ids=lambda v: str(v) if not hasattr(v, "engine_id") else v.transfer_mode,
)
def test_strategy_table(mode, identity, serial_only, expected) -> None:
    assert choose_strategy(mode, identity, serial_only) == expected
