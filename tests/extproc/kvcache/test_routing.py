"""KV-cache routing's parts: the config, where each engine publishes, the kv_cache policy, the
decision counting only what D lacks, the keyed chain, and no cost where it is off."""

from __future__ import annotations

import logging
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import orjson
import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from extproc.config import ConfigError, DecisionConfig
from extproc.kvcache.index import KvIndex, chain_keys
from extproc.kvcache.routing import KvRouting, approximated_groups, event_sources, kv_groups
from extproc.kvcache.scope import PLAIN, CacheScope
from extproc.kvcache.tokenize_workers import WorkerProcesses
from extproc.kvcache.watchers import EventSource
from extproc.metrics import Metrics
from extproc.policies import KvCacheOptions, KvCachePicker, PickRequest, PrefixPicker
from extproc.request.parse import Api, parse_request
from extproc.request.plan import pick_request, request_tokens
from extproc.roles import Role
from extproc.scheduling.decision import Sides, decide
from extproc.scheduling.pool import EndpointState, Pool
from extproc.scheduling.scheduler import Scheduler, WithPrefill, pool_picker
from tests.extproc.kvcache.kv_events_helpers import BLOCK, chain, removed
from tests.extproc.kvcache.kv_events_helpers import batch as _batch
from tests.support.routing import fixed_routing_config

LOAD_AWARE = DecisionConfig(mode="load_aware", pd_overhead_ms=0)
IDLE = Sides(0, 0, 0, 0, 0, 0)
BUSY_D = Sides(
    running_d=8, waiting_d=0, kv_usage_d=0.2, pending_d_tokens=0, queued_p_tokens=0, waiting_p=0
)
P1, P2, D1, D2 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    vocab = {w: i for i, w in enumerate(["<unk>", *(f"w{i}" for i in range(64))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def config(tokenizer: str | None, **pool: object) -> dict[str, object]:
    return {
        "prefill": {"endpoints": [P1, P2], **pool},
        "decode": {"endpoints": [D1], **pool},
        **({"tokenizer": tokenizer} if tokenizer else {}),
    }


# ---- config and sources ------------------------------------------------------------------


def test_every_member_publishes_at_its_host_on_the_pools_ports(tokenizer_dir: Path) -> None:
    cfg = fixed_routing_config(
        config(str(tokenizer_dir), kv_events={"port": 7000, "replay_port": None})
    )
    members = {"": {Role.PREFILL: [P1, "10.9.9.9:8000"], Role.DECODE: ["[fd00::1]:9000"]}}
    assert event_sources(cfg, members, {""}) == {
        P1: EventSource("tcp://10.0.0.1:7000"),
        "10.9.9.9:8000": EventSource("tcp://10.9.9.9:7000"),  # discovered: the pool's ports
        "[fd00::1]:9000": EventSource("tcp://[fd00::1]:7000"),
    }
    assert event_sources(cfg, members, set()) == {}  # the group has no tokenizer loaded


def test_a_static_endpoint_may_name_its_own_sockets(tokenizer_dir: Path) -> None:
    own = {"address": P2, "kv_events": {"port": 7100, "replay_port": 7101}}
    ipc = {"address": D1, "kv_events": {"endpoint": "ipc:///run/d.pub"}}
    cfg = fixed_routing_config(
        {
            "prefill": {"endpoints": [P1, own], "kv_events": {}},
            "decode": {"endpoints": [ipc], "kv_events": {"topic": "kv"}},
            "tokenizer": str(tokenizer_dir),
        }
    )
    sources = event_sources(cfg, {"": {Role.PREFILL: [P1, P2], Role.DECODE: [D1]}}, {""})
    assert sources == {
        P1: EventSource("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        P2: EventSource("tcp://10.0.0.2:7100", "tcp://10.0.0.2:7101"),
        D1: EventSource("ipc:///run/d.pub", None, "kv"),
    }


def test_members_that_connect_to_the_listener_are_followed_by_address_model_and_rank(
    tokenizer_dir: Path,
) -> None:
    """`kv_events: {mode: listen}`: no socket of the engine's to subscribe to; its member,
    model group and rank, and a replay socket only where replay_port is set."""
    cfg = fixed_routing_config(
        {
            "prefill": {"endpoints": [P1], "kv_events": {"mode": "listen"}},
            "decode": {"endpoints": [D1], "kv_events": {"mode": "listen", "replay_port": 7100}},
            "tokenizer": str(tokenizer_dir),
        }
    )
    assert cfg.kv_listener.host == "127.0.0.1"  # reachable from this host alone by default
    members = {"": {Role.PREFILL: [P1], Role.DECODE: [D1]}}
    ranks = {P1: 1, D1: 2}
    sources = event_sources(cfg, members, {""}, lambda role, address: ranks[address])
    assert sources == {
        P1: EventSource("", None, "", P1, None, ""),
        f"{D1} dp0": EventSource("", "tcp://10.0.0.3:7100", "", D1, 0, ""),
        f"{D1} dp1": EventSource("", "tcp://10.0.0.3:7101", "", D1, 1, ""),
    }
    with pytest.raises(ConfigError, match="an IP address to bind"):
        fixed_routing_config({**config(None), "kv_listener": {"host": "gateway-epp"}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (config("/nowhere"), "tokenizer: /nowhere: no tokenizer.json there"),
        (
            {
                "prefill": {"endpoints": [{"address": P1, "kv_events": {"port": 1}}]},
                "decode": {"endpoints": [D1]},
            },
            "prefill: Value error, an endpoint's kv_events ports need the pool's kv_events",
        ),
        (config(None, kv_events={"port": 0}), "prefill.kv_events.port: Input should be greater"),
        (
            {
                "prefill": {
                    "endpoints": [{"address": P1, "kv_events": {"endpoint": "udp://x"}}],
                    "kv_events": {},
                },
                "decode": {"endpoints": [D1]},
            },
            "prefill.endpoints.0.kv_events: Value error, a ZMQ address: tcp://host:port or ipc",
        ),
        (
            {
                "prefill": {
                    "endpoints": [{"address": P1, "kv_events": {"replay_port": 2}}],
                    "kv_events": {},
                },
                "decode": {"endpoints": [D1]},
            },
            "prefill.endpoints.0.kv_events: Value error, give port (and replay_port) or endpoint",
        ),
    ],
)
def test_bad_kv_settings_fail_at_load_in_one_line(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        fixed_routing_config(data)
    assert str(error.value).splitlines()[0].startswith(message.replace("Value error, ", ""))


def test_kv_events_without_a_tokenizer_warn_once_and_route_without(
    caplog: pytest.LogCaptureFixture,
) -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    cfg = fixed_routing_config(config(None, kv_events={}))
    with caplog.at_level(logging.WARNING, "extproc"):
        routing.configure(kv_groups(cfg))
        routing.configure(kv_groups(cfg))  # a reload
    assert [r.getMessage() for r in caplog.records] == [
        "the top-level pools: kv_events are set but no tokenizer, and the KV index needs the "
        "prompts' token ids: it routes without the KV cache. Set `tokenizer:` (the model's "
        "folder or tokenizer.json) to route by the engines' events"
    ]
    assert routing.tokenizer_for("") is None and not routing.enabled
    assert not routing.approximates("")


def test_kv_events_without_a_tokenizer_say_kv_cache_routes_by_what_was_sent_where(
    caplog: pytest.LogCaptureFixture,
) -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    cfg = fixed_routing_config(config(None, kv_events={}, policy="kv_cache"))
    with caplog.at_level(logging.WARNING, "extproc"):
        routing.configure(kv_groups(cfg), approximated_groups(cfg))
    assert [r.getMessage() for r in caplog.records] == [
        "the top-level pools: kv_events are set but no tokenizer, and the KV index needs the "
        "prompts' token ids: kv_cache routes by what this sidecar sent where (an estimate "
        "over the prompts' bytes). Set `tokenizer:` (the model's folder or tokenizer.json) "
        "to route by the engines' events"
    ]
    assert routing.tokenizer_for("") is None and routing.approximates("")


@pytest.mark.parametrize(
    ("pool", "approximated"),
    [
        ({"policy": "kv_cache"}, {""}),  # no events, no tokenizer: what was sent where
        ({"policy": "kv_cache", "kv_approximate": False}, set()),  # the operator said no
        ({"policy": "prefix"}, set()),
    ],
)
def test_which_groups_route_by_what_was_sent_where(
    pool: dict[str, object], approximated: set[str], tokenizer_dir: Path
) -> None:
    cfg = fixed_routing_config(config(None, **pool))
    assert approximated_groups(cfg) == approximated
    routing = KvRouting(KvIndex(100), Metrics())
    routing.configure(kv_groups(cfg), approximated_groups(cfg))
    assert routing.approximates("") is bool(approximated)
    tokenized = fixed_routing_config(config(str(tokenizer_dir), kv_events={}, **pool))
    routing.configure(kv_groups(tokenized), approximated_groups(tokenized))
    assert not routing.approximates("")  # its tokens and the engines' events rule


async def test_a_reload_that_drops_a_tokenizer_ends_its_worker_processes(
    tokenizer_dir: Path,
) -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    cfg = fixed_routing_config(config(str(tokenizer_dir), kv_events={}))
    routing.configure(kv_groups(cfg))
    old = routing.tokenizer_for("")
    assert old is not None
    routing.start()  # the workers start
    try:
        routing.configure(kv_groups(cfg))  # a reload that keeps it
        assert routing.tokenizer_for("") is old
        assert isinstance(old._pool, WorkerProcesses) and old._pool._all  # its workers run
        routing.configure(kv_groups(fixed_routing_config(config(None))))  # a reload without it
        assert routing.tokenizer_for("") is None
        assert old._pool._all == []  # its workers ended, not left running
    finally:
        await routing.stop()


# ---- the policy --------------------------------------------------------------------------


def states(*addresses: str, in_flight: tuple[int, ...] = ()) -> list[EndpointState]:
    return [
        EndpointState(a, in_flight=n)
        for a, n in zip(addresses, in_flight or (0,) * len(addresses), strict=True)
    ]


SYSTEM, QUESTION = 2048, 64  # a shared system prompt and a fresh question, in tokens
HELD = PickRequest(prefix=b"x", prompt_tokens=SYSTEM + QUESTION, cached={P1: 0, P2: SYSTEM})


def test_with_equal_load_the_engine_holding_the_prompt_wins() -> None:
    picker = KvCachePicker()
    assert picker.pick(states(P1, P2), HELD).address == P2
    assert picker.pick(states(P1, P2, in_flight=(3, 3)), HELD).address == P2


def test_the_holder_loses_once_the_work_queued_there_exceeds_what_its_cache_saves() -> None:
    picker = KvCachePicker(KvCacheOptions(kv_request_tokens=0, kv_cached_token_weight=1))
    holder, other = states(P2, P1)
    holder.pending_tokens = SYSTEM - 1  # the saving: SYSTEM tokens not computed
    assert picker.pick([other, holder], HELD) is holder
    holder.pending_tokens = SYSTEM + 1
    assert picker.pick([other, holder], HELD) is other
    # by default a cached token counts twice (this request's wait, and those after it)
    assert KvCachePicker().pick([other, holder], HELD) is holder
    holder.pending_tokens = 2 * SYSTEM + 1
    assert KvCachePicker().pick([other, holder], HELD) is other
    # requests count `kv_request_tokens` each on top of their tokens: 33 × 64 > 2048
    picker = KvCachePicker(KvCacheOptions(kv_request_tokens=64, kv_cached_token_weight=1))
    holder.pending_tokens, holder.in_flight = 0, 33
    assert picker.pick([other, holder], HELD) is other


Load = dict[str, tuple[int, int]]  # endpoint → (in flight, pending tokens)


def burst(
    scheduler: Scheduler, cfg: object, wanted: PickRequest, count: int
) -> tuple[list[object], Load, Load]:
    """`count` requests picked one after another, all still in flight (a burst): the picks,
    and the prefill and decode pools' load at its end."""
    from extproc.config import Config

    assert isinstance(cfg, Config)
    with ExitStack() as inflight:
        picks = [scheduler.pick(wanted, inflight, cfg) for _ in range(count)]
        loads = [
            {s.address: (s.in_flight, s.pending_tokens) for s in pool}
            for pool in (scheduler.prefill, scheduler.decode)
        ]
    assert all(s.pending_tokens == s.in_flight == 0 for s in scheduler.prefill)
    assert all(s.pending_tokens == s.in_flight == 0 for s in scheduler.decode)
    return picks, loads[0], loads[1]


def test_a_burst_spreads_once_the_holders_queue_outweighs_its_cache(tokenizer_dir: Path) -> None:
    """64 requests of one group at once, P2 and D2 holding its system prompt: each pick raises
    the work counted where it went, so the holders take requests only while that is less than
    what their caches save, and the others take the rest (P/D, nothing decode-only)."""
    cfg = fixed_routing_config(
        {
            "prefill": {"endpoints": [P1, P2], "policy": "kv_cache", "kv_events": {}},
            "decode": {"endpoints": [D1, D2], "policy": "kv_cache", "kv_events": {}},
            "tokenizer": str(tokenizer_dir),
        }
    )
    scheduler = scheduler_for(cfg, KvRouting(KvIndex(100), Metrics()))
    wanted = PickRequest(
        prefix=b"x", prompt_tokens=SYSTEM + QUESTION, cached={P2: SYSTEM, D2: SYSTEM}
    )
    picks, prefill_load, decode_load = burst(scheduler, cfg, wanted, 64)
    assert all(isinstance(p, WithPrefill) for p in picks)
    on_p = [p.prefill for p in picks if isinstance(p, WithPrefill)]
    on_d = [p.decodes[0] for p in picks if isinstance(p, WithPrefill)]
    for role, went, (holder, other) in (("P", on_p, (P2, P1)), ("D", on_d, (D2, D1))):
        # 64 uncached + 64 a pick: 32 × 128 = 2 × 2048
        assert went[:32] == [holder] * 32, role
        # then the other engine's turns come: 62 questions (3968 tokens) on the holder,
        # 2 whole prompts (4224) on the other, about the same prefill time on each
        assert went.count(other) == 2, role
        assert went.count(holder) > went.count(other), role  # the cache still pays
    for load, holder, other in ((prefill_load, P2, P1), (decode_load, D2, D1)):
        # each pick counted the tokens its engine lacked: the question on the holder, all on
        # the other
        assert load[holder][1] == load[holder][0] * QUESTION
        assert load[other][1] == load[other][0] * (SYSTEM + QUESTION)
        ahead = {e: pending + n * 64 for e, (n, pending) in load.items()}
        # the work queued on the holder, less its saving, is within one request of the other's
        assert abs(ahead[holder] - 2 * SYSTEM - ahead[other]) <= SYSTEM + QUESTION + 64


def test_nothing_known_to_be_cached_falls_back_to_prompt_hashing() -> None:
    for cached in (None, {}, {P1: 0}):
        for key in (b"a", b"b", b"c", b"d"):
            request = PickRequest(prefix=key, prompt_tokens=10, cached=cached)
            expected = PrefixPicker().pick(states(P1, P2), request).address
            assert KvCachePicker().pick(states(P1, P2), request).address == expected


# ---- the decision ------------------------------------------------------------------------


def test_a_prompt_d_holds_mostly_goes_alone_and_one_it_does_not_through_p() -> None:
    assert decide(LOAD_AWARE, 2000, IDLE, 30.0).reason == "faster_pd"  # equal: P/D
    assert decide(LOAD_AWARE, 2000, IDLE, 30.0, d_cached=1900).reason == "faster_alone"
    # P holding it as much as D does gives D no edge
    assert decide(LOAD_AWARE, 2000, IDLE, 30.0, 1900, 1900).reason == "faster_pd"


def test_a_busy_decode_holding_the_prompt_still_keeps_its_stall_budget() -> None:
    cfg = DecisionConfig(mode="load_aware")
    assert decide(cfg, 2000, BUSY_D, 30.0).reason == "stall_budget"  # 116 ms of prefill
    assert decide(cfg, 2000, BUSY_D, 30.0, d_cached=1900).decode_only  # ~6 ms: it fits
    full = Sides(8, 0, 0.95, 0, 0, 0)
    assert decide(cfg, 2000, full, 30.0, d_cached=1990).reason == "kv_pressure"


def test_threshold_counts_the_tokens_d_lacks() -> None:
    cfg = DecisionConfig(mode="threshold", max_prompt_tokens=100)
    assert not decide(cfg, 1000, IDLE, 0).decode_only
    assert decide(cfg, 1000, IDLE, 0, d_cached=960).decode_only


# ---- the request path ----------------------------------------------------------------------


async def test_no_kv_events_means_no_tokenizing_and_no_lookup(tokenizer_dir: Path) -> None:
    cfg = fixed_routing_config(
        config(str(tokenizer_dir))
    )  # a tokenizer, but no pool with kv_events
    routing = KvRouting(KvIndex(100), Metrics())
    routing.configure(kv_groups(cfg))
    scheduler = scheduler_for(cfg, routing)
    request = parse_request(Api.COMPLETIONS, completion("w1 w2 w3 w4"), 1 << 20)
    assert await request_tokens(request, scheduler) is None
    assert pick_request(request, None).cached is None


async def test_a_routed_request_is_looked_up_and_its_share_counted(tokenizer_dir: Path) -> None:
    cfg = fixed_routing_config(config(str(tokenizer_dir), kv_events={}, policy="kv_cache"))
    metrics = Metrics()
    routing = KvRouting(KvIndex(100), metrics)
    routing.configure(kv_groups(cfg))
    routing.index.apply(P2, _decoded(chain(1, [1, 2, 3, 4, 5, 6, 7, 8])))
    routing.learn_base_model(P2, "m")  # "m" is no LoRA adapter
    scheduler = scheduler_for(cfg, routing, metrics)
    request = parse_request(Api.COMPLETIONS, completion("w0 w1 w2 w3 w4 w5 w6 w7 w8"), 1 << 20)
    tokens = await request_tokens(request, scheduler)
    assert tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    wanted = pick_request(request, None, tokens=tokens, kv=routing)
    assert (wanted.prompt_tokens, wanted.cached) == (9, {P2: 2 * BLOCK})
    with ExitStack() as inflight:
        picked = scheduler.pick(wanted, inflight, cfg)
    assert isinstance(picked, WithPrefill) and picked.prefill == P2
    text = metrics.render().decode()
    assert 'pd_extproc_kv_routed_prompt_tokens_total{role="prefill"} 9.0' in text
    assert 'pd_extproc_kv_cached_prompt_tokens_total{role="prefill"} 8.0' in text
    assert 'pd_extproc_kv_cached_prompt_tokens_total{role="decode"} 0.0' in text
    await routing.stop()


def scheduler_for(cfg: object, routing: KvRouting, metrics: Metrics | None = None) -> Scheduler:
    from extproc.config import Config

    assert isinstance(cfg, Config)
    prefill = Pool(Role.PREFILL, cfg.static_addresses(Role.PREFILL), pool_picker(cfg.prefill))
    decode = Pool(Role.DECODE, cfg.static_addresses(Role.DECODE), pool_picker(cfg.decode))
    return Scheduler(cfg, prefill, decode, metrics or Metrics(), routing)


def completion(prompt: str) -> bytes:
    return orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 1})


def _decoded(*events: dict[str, object]) -> list[object]:
    from extproc.kvcache.events import decode_batch

    return list(decode_batch(_batch(*events)).events)


# ---- the chain ---------------------------------------------------------------------------


def test_the_chain_is_keyed_per_process() -> None:
    code = "from extproc.kvcache.index import chain_keys; print(chain_keys(list(range(16)), 4))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        ).stdout
        for _ in range(2)
    }
    assert len(runs) == 2  # another process, another key: nobody can craft a collision
    keys = chain_keys(list(range(16)), 4)
    assert len(set(keys)) == 4 and all(0 <= k < 1 << 60 for k in keys)
    assert chain_keys([-1, 2, 3, 4], 4) == [] and chain_keys([1 << 40, 2, 3, 4], 4) == []


def test_each_rank_of_a_data_parallel_member_publishes_on_the_ports_plus_its_rank(
    tokenizer_dir: Path,
) -> None:
    cfg = fixed_routing_config(
        config(str(tokenizer_dir), kv_events={"port": 7000, "replay_port": 7100})
    )
    members = {"": {Role.PREFILL: [P1, P2], Role.DECODE: [D1]}}
    sources = event_sources(cfg, members, {""}, lambda role, a: 2 if a == P1 else 1)
    assert sources == {
        f"{P1} dp0": EventSource("tcp://10.0.0.1:7000", "tcp://10.0.0.1:7100", "", P1, 0),
        f"{P1} dp1": EventSource("tcp://10.0.0.1:7001", "tcp://10.0.0.1:7101", "", P1, 1),
        P2: EventSource("tcp://10.0.0.2:7000", "tcp://10.0.0.2:7100"),
        D1: EventSource("tcp://10.0.0.3:7000", "tcp://10.0.0.3:7100"),
    }


def test_a_lookup_folds_a_servers_ranks_into_it_and_keeps_each() -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    rank = {
        f"{P1} dp{r}": EventSource(f"tcp://10.0.0.1:{7000 + r}", None, "", P1, r) for r in (0, 1)
    }
    routing.follow({**rank, P2: EventSource("tcp://10.0.0.2:7000")})
    assert set(routing.watched) == {P1, P2}  # the pool members (the restart detector's)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    routing.index.apply(f"{P1} dp1", _decoded(chain(1, prompt[:8])))
    routing.index.apply(f"{P1} dp0", _decoded(chain(1, prompt[:4])))
    found = routing.lookup(prompt)
    assert found.by_endpoint == {P1: 8} and found.by_rank == {P1: {0: 4, 1: 8}}
    assert routing.cached_tokens(prompt) == {P1: 8}
    silent = D1  # an engine not heard from, estimated: the ranks are kept beside it
    routing.remember([silent], prompt + list(range(40)))
    found = routing.lookup(prompt + list(range(40)))
    assert found.by_rank == {P1: {0: 4, 1: 8}} and found.by_endpoint[silent] == 48
    routing.remember([P1], list(range(100, 140)))  # heard from (its ranks): nothing guessed
    assert routing.cached_tokens(list(range(100, 140))) == {P1: 0}
    routing.engine_restarted(P1)  # one process: every rank's entries go
    assert routing.index.blocks == 0


def test_an_engine_that_connects_without_ranks_is_no_rank_of_a_server() -> None:
    metrics = Metrics()
    routing = KvRouting(KvIndex(100), metrics)
    routing.follow({P1: EventSource("", address=P1)})  # it connects to the listener
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    routing.index.apply(P1, _decoded(chain(1, prompt)))
    found = routing.lookup(prompt)
    assert found.by_endpoint == {P1: 8} and found.by_rank == {}
    routing.engine_restarted(P1)  # its entries go, counted once
    assert metrics.kv_index_resets.labels(P1, "restart")._value.get() == 1


def test_a_p_that_evicted_a_prompt_it_was_sent_still_draws_it_and_counts_only_its_rest(
    tokenizer_dir: Path,
) -> None:
    """The prefill pool scores and loads a P by what it was sent (`sent_or_held`); the
    decision and the metrics by what it holds. Without it, P1 (a little busier, and the
    prompt's events gone from it) lost the prompt to P2 and counted all 40 tokens as its."""
    cfg = fixed_routing_config(config(str(tokenizer_dir), kv_events={}, policy="kv_cache"))
    metrics = Metrics()
    routing = KvRouting(KvIndex(100), metrics)
    tokens = list(range(1, 41))
    for engine in (P1, P2, D1):  # each heard from, holding none of the prompt
        routing.index.apply(engine, _decoded(chain(500 + len(engine), [0] * BLOCK)))
    routing.remember([P1, D1], tokens, prefill=P1)
    found = routing.lookup(tokens)
    wanted = PickRequest(
        prefix=b"x",
        prompt_tokens=40,
        cached=found.by_endpoint,
        sent_or_held=found.sent_or_held,
    )
    scheduler = scheduler_for(cfg, routing, metrics)
    scheduler.prefill.get(P1).pending_tokens = 10
    with ExitStack() as inflight:
        picked = scheduler.pick(wanted, inflight, cfg)
        assert isinstance(picked, WithPrefill) and picked.prefill == P1
        assert scheduler.prefill.get(P1).pending_tokens == 10 + 40 - 32
    assert 'pd_extproc_kv_cached_prompt_tokens_total{role="prefill"} 0.0' in (
        metrics.render().decode()
    )


def test_the_kv_cache_policy_pins_the_rank_holding_the_prompt(tokenizer_dir: Path) -> None:
    cfg = fixed_routing_config(
        config(str(tokenizer_dir), kv_events={}, policy="kv_cache", data_parallel_size=2)
    )
    routing = KvRouting(KvIndex(100), Metrics())
    routing.follow(
        event_sources(
            cfg, {"": {role: cfg.static_addresses(role) for role in Role}}, {""}, lambda r, a: 2
        )
    )
    tokens = list(range(1, 10))
    routing.index.apply(f"{P2} dp1", _decoded(chain(1, tokens[:8])))
    routing.index.apply(f"{D1} dp0", _decoded(chain(1, tokens[:4])))
    found = routing.lookup(tokens)
    wanted = PickRequest(
        prefix=b"x", prompt_tokens=9, cached=found.by_endpoint, rank_cached=found.by_rank
    )
    scheduler = scheduler_for(cfg, routing)
    for _ in range(3):  # every time, not in turn
        with ExitStack() as inflight:
            picked = scheduler.pick(wanted, inflight, cfg)
            assert isinstance(picked, WithPrefill) and picked.prefill == P2
            assert (picked.prefill_counted.rank, picked.decode_counted.rank) == (1, 0)
            assert scheduler.prefill.get(P2).pending_tokens == 1  # what rank 1 lacks
            assert scheduler.decode.get(D1).pending_tokens == 5  # and what D's rank 0 lacks
    picker = KvCachePicker()
    assert picker.pick_rank([0, 0], {}, 9) is None  # no rank holds any: the least loaded
    assert picker.pick_rank([0, 0, 0], {2: 8}, 9) == 2
    assert picker.pick_rank([0, 1], {1: 8}, 9) == 0  # a request queued outweighs 8 tokens
    assert picker.pick_rank([0, 1], {1: SYSTEM}, SYSTEM + QUESTION) == 1  # not a long prefix


def test_the_example_config_in_the_docs_loads(tokenizer_dir: Path) -> None:
    text = (Path(__file__).parents[3] / "docs" / "kv-cache.md").read_text()
    example = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    example["tokenizer"] = str(tokenizer_dir)  # the tiny model may not be built here
    cfg = fixed_routing_config(example)
    assert (cfg.prefill.policy, cfg.decode.policy) == ("kv_cache", "kv_cache")
    members = {"": {role: cfg.static_addresses(role) for role in Role}}
    assert len(set(event_sources(cfg, members, {""}).values())) == 4  # a port pair each


# ---- the follower --------------------------------------------------------------------------


async def test_the_follower_subscribes_drops_leavers_clears_restarts_and_stops() -> None:
    import asyncio

    import zmq.asyncio

    from extproc.kvcache.watchers import KvEventWatchers
    from tests.extproc.kvcache.kv_events_helpers import FakeEngine, joined
    from tests.support.topology import until

    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx)
    index, metrics = KvIndex(100), Metrics()
    routing = KvRouting(index, metrics, KvEventWatchers(index, metrics, context=ctx))
    try:
        routing.start()
        routing.follow({"a": EventSource(engine.endpoint, engine.replay_endpoint)})

        async def subscribed() -> bool:
            return "a" in routing.watchers.sources()

        await until(subscribed, "the follower to subscribe")
        events = routing.watchers._watching["a"][1]
        await joined(engine, events)
        events.applied.clear()
        await engine.send(_batch(chain(1, [1, 2, 3, 4, 5, 6, 7, 8])))
        await asyncio.wait_for(events.applied.wait(), 10)
        assert index.blocks == 2
        routing.engine_restarted("a")  # the restart detector saw a new start time
        assert index.blocks == 0
        assert 'endpoint="a",reason="restart"} 1.0' in metrics.render().decode()
        routing.engine_restarted("not-watched")  # nothing to clear, nothing counted
        routing.follow({})  # it left the pool: out of the index at once
        assert index.engines() == []
        task = routing._task
    finally:
        await routing.stop()
        await engine.close()
        ctx.term()
    assert task is not None and task.done() and routing.watchers.sources() == {}


async def test_the_follower_still_follows_a_change_after_a_wake_up_with_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    import extproc.kvcache.routing as routing_module
    from tests.support.polling import until_true

    monkeypatch.setattr(routing_module, "_FOLLOW_WAIT_S", 0.01)
    index, metrics = KvIndex(100), Metrics()
    routing = KvRouting(index, metrics)
    waits = 0

    class Changed(asyncio.Event):
        async def wait(self) -> bool:  # type: ignore[override]
            nonlocal waits
            waits += 1
            return await super().wait()

    routing._changed = Changed()
    try:
        routing.start()
        await until_true(lambda: waits >= 2, "a wake-up with no change")
        routing.follow({"a": EventSource("tcp://127.0.0.1:1")})
        await until_true(lambda: "a" in routing.watchers.sources(), "the change followed")
    finally:
        await routing.stop()


# ---- engines without events: where prompts were routed -------------------------------------


def test_routed_blocks_count_for_engines_not_heard_from_only() -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    prompt = list(range(40))  # two blocks of 16
    routing.remember([P1, P2], prompt)
    assert routing.cached_tokens(prompt) == {P1: 32, P2: 32}
    assert routing.cached_tokens([*prompt[:16], 99, *prompt[17:]]) == {P1: 16, P2: 16}
    routing.index.apply(P2, _decoded(chain(1, [1, 2, 3, 4])))  # P2 publishes: its events rule
    assert routing.cached_tokens(prompt) == {P1: 32, P2: 0}
    routing.remember([P2], list(range(100, 140)))  # not remembered for an engine heard from
    assert routing.cached_tokens(list(range(100, 140))) == {P2: 0}
    routing.forget(P1)  # it left the pool
    assert routing.cached_tokens(prompt) == {P2: 0}
    routing.remember([P1], prompt)
    routing.engine_restarted(P1)  # a restart empties it
    assert routing.cached_tokens(prompt) == {P2: 0}


def test_what_was_sent_to_an_engine_not_heard_from_reaches_it_once_landed() -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    prompt = list(range(40))  # two blocks of 16
    routing.index.apply(P2, _decoded(chain(1, [1, 2, 3, 4])))  # P2 publishes: its events rule
    routing.remember([P1, P2], prompt)
    cached = routing.lookup(prompt)
    assert (cached.by_endpoint, cached.landed) == ({P1: 32, P2: 0}, {P2: 0})
    assert routing.sent_keys(P2, prompt) == []  # heard from: nothing to land
    routing.land(P1, routing.sent_keys(P1, prompt))
    assert routing.lookup(prompt).landed == {P1: 32, P2: 0}


def test_a_p_is_credited_in_the_prefill_pools_view_with_what_it_was_sent_and_evicted() -> None:
    """`Cached.sent_or_held`: a P heard from that evicted a prompt this sidecar sent it (before
    its first events too) keeps that depth there; what the engines hold (`by_endpoint`, which
    the decision and the metrics read) stays what their events say."""
    routing = KvRouting(KvIndex(100), Metrics())
    prompt = list(range(40))  # two blocks of 16 for the memory, ten of 4 for the events
    routing.remember([P1, D1], prompt, prefill=P1)  # neither heard from yet
    routing.index.apply(P1, _decoded(chain(1, prompt[:32])))
    routing.index.apply(D1, _decoded(chain(100, [7] * BLOCK)))
    cached = routing.lookup(prompt)
    assert (cached.by_endpoint, cached.sent_or_held) == ({P1: 32, D1: 0}, None)
    routing.index.apply(P1, _decoded(removed(list(range(5, 9)))))  # P1 evicted half of it
    cached = routing.lookup(prompt)
    assert (cached.by_endpoint, cached.sent_or_held) == ({P1: 16, D1: 0}, {P1: 32, D1: 0})
    assert routing.lookup(list(range(100, 140))).sent_or_held is None  # sent nowhere
    routing.remember([D1], list(range(100, 140)))  # decode-only: no P was sent it
    assert routing.lookup(list(range(100, 140))).sent_or_held is None
    routing.engine_restarted(P1)  # a restarted P was sent nothing it holds
    assert routing.lookup(prompt).sent_or_held is None


def test_a_p_is_credited_with_the_start_of_a_long_prompt_it_was_sent() -> None:
    """A P leg's prompt is remembered by its first 4096 tokens (what draws it back, at a
    bounded cost per request); an engine not heard from keeps the whole prompt's estimate."""
    routing = KvRouting(KvIndex(100), Metrics())
    prompt = list(range(5000))
    routing.remember([P1, D1], prompt, prefill=P1)
    routing.index.apply(P1, _decoded(chain(1, [7] * BLOCK)))  # heard from, holding none of it
    cached = routing.lookup(prompt)
    assert cached.by_endpoint == {P1: 0, D1: 4992}  # D1: the estimate, 312 whole blocks of 16
    assert cached.sent_or_held == {P1: 4096, D1: 4992}


def test_routed_blocks_count_only_in_the_scope_they_were_routed_in() -> None:
    """A prompt sent plain is not credited to the same prompt salted or for an adapter (the
    engine would not reuse those blocks), and a salted one only to its own salt."""
    routing = KvRouting(KvIndex(100), Metrics())
    prompt = list(range(40))  # two blocks of 16
    routing.remember([P1], prompt)
    salted, adapter = CacheScope(salt="s"), CacheScope(adapter="a")
    assert routing.cached_tokens(prompt) == {P1: 32}
    assert routing.cached_tokens(prompt, salted) == {}
    assert routing.cached_tokens(prompt, adapter) == {}
    routing.remember([P2], prompt, salted)
    assert routing.cached_tokens(prompt, salted) == {P2: 32}
    assert routing.cached_tokens(prompt, CacheScope(salt="t")) == {}
    assert routing.cached_tokens(prompt) == {P1: 32}


def test_a_model_is_an_adapter_unless_an_engine_serves_it_as_its_base() -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    assert routing.scope_of("m", {}) == CacheScope(adapter="m")  # nothing learnt: no credit
    routing.learn_base_model(D1, "m")
    assert routing.scope_of("m", {}) == PLAIN
    assert routing.scope_of("m", {"cache_salt": "s"}) == CacheScope(salt="s")
    assert routing.scope_of("m-lora", {}) == CacheScope(adapter="m-lora")
    assert routing.scope_of("m", {"cache_salt": 7}) == CacheScope(salt="7")
    routing.forget(D1)  # it left its pool
    assert routing.scope_of("m", {}) == CacheScope(adapter="m")


def test_every_served_name_of_a_base_model_is_the_base_model() -> None:
    """`--served-model-name m alias`: the metrics say `m`, /v1/models lists both; a request
    for `alias` is keyed as the base model's, as vLLM keys it, and keeps its cache credit."""
    routing = KvRouting(KvIndex(100), Metrics())
    routing.learn_base_model(D1, "m")  # the scraper, every round
    routing.learn_base_names(P1, ["m", "alias"])  # the probe
    routing.learn_base_model(D1, "m")
    assert routing.scope_of("alias", {}) == PLAIN
    assert routing.scope_of("m", {}) == PLAIN
    assert routing.scope_of("m-lora", {}) == CacheScope(adapter="m-lora")
    routing.forget(P1)
    assert routing.scope_of("alias", {}) == CacheScope(adapter="alias")
    assert routing.scope_of("m", {}) == PLAIN


def test_an_engine_that_leaves_or_restarts_loses_what_it_was_sent_by_bytes() -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    keys = routing.routed_bytes.keys(b"z" * 512)
    routing.remember_bytes([P1, P2], keys)
    assert routing.routed_bytes.held(keys) == {P1: 512, P2: 512}
    routing.forget(P1)  # it left the pool
    assert routing.routed_bytes.held(keys) == {P2: 512}
    routing.engine_restarted(P2)  # its cache is gone
    assert routing.routed_bytes.held(keys) == {}


def test_routed_blocks_stay_within_their_bound() -> None:
    from extproc.kvcache.routed import RoutedBlocks

    routed = RoutedBlocks(max_blocks=640, block_size=4)
    for n in range(1000):
        routed.remember(P1 if n % 2 else P2, routed.keys(list(range(n * 8, n * 8 + 8))))
        assert len(routed) <= 640
    last = routed.keys(list(range(999 * 8, 999 * 8 + 8)))
    assert routed.held(last, {P1, P2}) == {P1: 8}  # the newest kept, the oldest gone
    assert routed.held(routed.keys(list(range(8))), {P1, P2}) == {}
    routed.forget(P1)
    assert routed.engines() == {P2} and len(routed) == sum(1 for _ in routed._routed)


def test_a_groups_context_is_the_longest_any_of_its_engines_said() -> None:
    routing = KvRouting(KvIndex(1000), Metrics())
    assert routing.context("m") is None
    routing.context_length("m", 4096)
    routing.context_length("m", 8192)
    routing.context_length("m", 2048)
    assert routing.context("m") == 8192
    assert routing.context("other") is None


def test_a_fit_limit_is_known_once_every_engine_has_said_its_length() -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    assert routing.fit_limit([]) is None
    routing.engine_context("p", 4096)
    assert routing.fit_limit(["p", "d"]) is None  # d has not said
    routing.engine_context("d", 8192)
    assert routing.fit_limit(["p", "d"]) == 8192
    routing.engine_context("d", None)  # went down
    assert routing.fit_limit(["p", "d"]) is None
    routing.engine_context("d", 2048)
    routing.forget("p")  # left its pool
    assert routing.fit_limit(["p", "d"]) is None and routing.fit_limit(["d"]) == 2048


# ---- what the tests above leave open (mutation testing) ------------------------------------


def test_sources_of_several_groups_listening_roles_and_decode_only_events(
    tokenizer_dir: Path,
) -> None:
    """The first group routes without the KV cache, the second's prefill publishes nothing:
    its decode still does; a listening engine's source names its group, with no topic; a
    role absent from the members has none."""
    tokenizer = str(tokenizer_dir)
    cfg = fixed_routing_config(
        {
            **config(None),
            "models": {
                "a": {
                    "prefill": {"endpoints": ["10.0.1.1:8000"]},
                    "decode": {"endpoints": ["10.0.1.3:8000"], "kv_events": {}},
                },
                "b": {
                    "prefill": {"endpoints": ["10.0.2.1:8000"]},
                    "decode": {
                        "endpoints": ["10.0.2.3:8000"],
                        "kv_events": {"mode": "listen", "topic": "kv"},
                    },
                    "tokenizer": tokenizer,
                },
                "c": {
                    "prefill": {"endpoints": ["10.0.3.1:8000"], "kv_events": {"topic": "kv"}},
                    "decode": {"endpoints": ["10.0.3.3:8000"], "kv_events": {}},
                    "tokenizer": tokenizer,
                },
            },
        }
    )
    members = {
        "a": {Role.DECODE: ["10.0.1.3:8000"]},
        "b": {Role.DECODE: ["10.0.2.3:8000"]},
        "c": {Role.PREFILL: ["10.0.3.1:8000"]},  # its decode members not known yet
    }
    # decode members of two ranks: the role is handed to ranks_of
    sources = event_sources(cfg, members, {"b", "c"}, lambda role, a: 1 + (role == Role.DECODE))
    assert sources == {
        "10.0.2.3:8000 dp0": EventSource("", None, "", "10.0.2.3:8000", 0, "b"),
        "10.0.2.3:8000 dp1": EventSource("", None, "", "10.0.2.3:8000", 1, "b"),
        "10.0.3.1:8000": EventSource("tcp://10.0.3.1:5557", "tcp://10.0.3.1:5558", "kv"),
    }


def test_a_static_endpoints_own_sockets_keep_their_replay_and_ranks_their_ipc_path(
    tokenizer_dir: Path,
) -> None:
    own = {"address": P2, "kv_events": {"endpoint": "tcp://10.0.0.2:7100"}}
    own = {**own, "kv_events": {**own["kv_events"], "replay_endpoint": "tcp://10.0.0.2:7200"}}
    ipc = {"address": D1, "kv_events": {"endpoint": "ipc:///run/kv:5557"}}
    cfg = fixed_routing_config(
        {
            "prefill": {"endpoints": [P1, own], "kv_events": {"replay_port": None}},
            "decode": {"endpoints": [ipc], "kv_events": {}},
            "tokenizer": str(tokenizer_dir),
        }
    )
    members = {"": {Role.PREFILL: [P1, P2], Role.DECODE: [D1]}}
    sources = event_sources(cfg, members, {""}, lambda role, a: 2)
    assert sources == {
        f"{P1} dp0": EventSource("tcp://10.0.0.1:5557", None, "", P1, 0),
        f"{P1} dp1": EventSource("tcp://10.0.0.1:5558", None, "", P1, 1),
        f"{P2} dp0": EventSource("tcp://10.0.0.2:7100", "tcp://10.0.0.2:7200", "", P2, 0),
        f"{P2} dp1": EventSource("tcp://10.0.0.2:7101", "tcp://10.0.0.2:7201", "", P2, 1),
        # not a TCP port: nothing to add the rank to
        f"{D1} dp0": EventSource("ipc:///run/kv:5557", None, "", D1, 0),
        f"{D1} dp1": EventSource("ipc:///run/kv:5557", None, "", D1, 1),
    }


def test_a_named_groups_missing_tokenizer_is_named_in_its_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    with caplog.at_level(logging.WARNING, "extproc"):
        routing.configure({"m": (True, None)})
    assert caplog.records[0].getMessage().startswith("model m: kv_events are set but no")


def test_engines_heard_from_take_no_room_among_the_routed_blocks() -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    routing.follow(
        {
            f"{P1} dp0": EventSource("tcp://10.0.0.1:7000", None, "", P1, 0),
            P2: EventSource("tcp://10.0.0.2:7000"),
        }
    )
    routing.index.apply(f"{P1} dp0", _decoded(chain(1, [1, 2, 3, 4])))
    routing.index.apply(P2, _decoded(chain(1, [1, 2, 3, 4])))
    routing.remember([P1, P2], list(range(40)))
    assert len(routing.routed) == 0  # the bound is kept for the engines that need it
    routing.remember([D1], list(range(40)))
    assert len(routing.routed) == 2


def test_base_models_are_kept_for_a_bounded_number_of_engines() -> None:
    routing = KvRouting(KvIndex(100), Metrics())
    full = [f"10.1.{i // 256}.{i % 256}:8000" for i in range(1024)]  # the bound
    for address in full:
        routing.learn_base_model(address, "m")
        routing.learn_base_names(address, ["m"])
    routing.learn_base_model("10.9.9.9:8000", "beyond")  # no room for another engine
    routing.learn_base_names("10.9.9.9:8000", ["beyond-name"])
    assert routing.scope_of("beyond", {}) == CacheScope(adapter="beyond")
    assert routing.scope_of("beyond-name", {}) == CacheScope(adapter="beyond-name")
    routing.learn_base_model(full[0], "renamed")  # a known engine may change its model
    routing.learn_base_names(full[1], ["m", "alias"])
    assert routing.scope_of("renamed", {}) == PLAIN
    assert routing.scope_of("alias", {}) == PLAIN
