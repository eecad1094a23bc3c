"""The engine scraper: one /metrics fetch per engine per interval, parsed once, handed to every
consumer (restart detection, engine load, prompt-token sources); and which engines it scrapes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from extproc.config import KvCheckConfig
from extproc.engines.kv_check import KvCheck, prompt_tokens_by_source
from extproc.engines.load import EngineLoad, parse_load, rank_loads
from extproc.engines.restarts import RestartDetector
from extproc.engines.scrape_plan import scrape_plan
from extproc.engines.scraper import EngineScraper, Families, parse_families
from extproc.metrics import Metrics
from extproc.policies import PickRequest
from extproc.scheduling.pool import EndpointState
from extproc.wiring import Runtime
from tests.support.routing import fixed_routing_config

VLLM_METRICS = """\
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e+09
# HELP vllm:num_requests_waiting Requests waiting
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_running Requests in the batch
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting_by_reason Requests waiting, by reason
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 50.0
# HELP vllm:kv_cache_usage_perc KV cache usage
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 10.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 90.0
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # data-parallel engines: queues and batches add, caches average
        (VLLM_METRICS, (5.0, 5.0, 0.375)),
        ("vllm:num_requests_waiting 7\n", (7.0, 0.0, 0.0)),
        ('vllm:gpu_cache_usage_perc{model_name="m"} 0.8\n', (0.0, 0.0, 0.8)),  # vLLM < 0.10
        ("process_start_time_seconds 1.7e9\n", (0.0, 0.0, 0.0)),  # not exported: neutral
        ("", (0.0, 0.0, 0.0)),
        ("not prometheus {{{\n", (0.0, 0.0, 0.0)),  # unparsable: neutral, no exception
    ],
)
def test_parse_load(text: str, expected: tuple[float, float, float]) -> None:
    assert parse_load(parse_families(text)) == pytest.approx(expected)


@dataclass
class Engines:
    """Two /metrics servers on 127.0.0.1: a vLLM-like one and one without /metrics (404)."""

    served: str
    missing: str
    body: list[str] = field(default_factory=lambda: [VLLM_METRICS])
    fetches: list[str] = field(default_factory=list)


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    runners = [web.AppRunner(web.Application()), web.AppRunner(web.Application())]
    state = Engines("", "")

    async def metrics(request: web.Request) -> web.Response:
        state.fetches.append(request.host)
        return web.Response(text=state.body[0], content_type="text/plain")

    runners[0].app.router.add_get("/metrics", metrics)
    addresses = []
    for runner in runners:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        addresses.append(f"127.0.0.1:{runner.addresses[0][1]}")
    state.served, state.missing = addresses
    yield state
    for runner in runners:
        await runner.cleanup()


@dataclass
class Recorder:
    families = ("vllm:",)
    seen: list[tuple[str, Families]] = field(default_factory=list)

    def consume(self, address: str, families: Families) -> None:
        self.seen.append((address, families))


async def test_one_fetch_feeds_every_consumer(engines: Engines) -> None:
    state = EndpointState(engines.served)
    kv_check = KvCheck(KvCheckConfig, Metrics(), lambda a: True)
    restarts: list[str] = []
    detector = RestartDetector(lambda a: True, restarts.append)
    async with aiohttp.ClientSession() as session:
        scraper = EngineScraper(
            lambda: session,
            lambda: {engines.served: 10.0},
            lambda: 1.0,
            [detector, EngineLoad(lambda a: state), kv_check],
        )
        await scraper.scrape_due()
        engines.body[0] = VLLM_METRICS.replace("1.7e+09", "1.8e+09")  # the engine restarted
        assert await scraper.scrape(engines.served)
    assert engines.fetches == [engines.served] * 2
    assert (state.waiting, state.kv_usage) == (5.0, 0.375)
    assert kv_check.snapshot()[engines.served]["external_kv_transfer"] == 90.0
    assert restarts == [engines.served]


async def test_an_engine_is_fetched_once_per_interval(engines: Engines) -> None:
    seen = Recorder()
    async with aiohttp.ClientSession() as session:
        plan = {engines.served: 10.0, engines.missing: 10.0}
        scraper = EngineScraper(lambda: session, lambda: plan, lambda: 1.0, [seen])
        assert await scraper.scrape(engines.served)  # e.g. the health checker's round
        assert not await scraper.scrape(engines.missing)  # 404: not healthy, nothing handed out
        await scraper.scrape_due()  # both were fetched just now: not due
    assert engines.fetches == [engines.served]
    assert [address for address, _ in seen.seen] == [engines.served]


def test_prompt_tokens_by_source_sums_per_source() -> None:
    totals = prompt_tokens_by_source(parse_families(VLLM_METRICS))
    assert totals == {"local_compute": 10.0, "external_kv_transfer": 90.0}
    assert prompt_tokens_by_source(parse_families("vllm:num_requests_waiting 1\n")) is None


def test_restart_detection_watches_only_its_engines() -> None:
    restarts: list[str] = []
    detector = RestartDetector(lambda a: a == "p", restarts.append)
    for started in ("1", "1", "2"):
        for address in ("p", "d"):
            detector.consume(address, parse_families(f"process_start_time_seconds {started}\n"))
    assert restarts == ["p"]


def test_a_stale_start_time_read_after_a_newer_one_is_no_restart() -> None:
    """The health check's and the load scraper's fetches of /metrics can cross: an answer
    from before the restart, read after one from after it, must not drop the identity just
    learned again."""
    restarts: list[str] = []
    detector = RestartDetector(lambda a: True, restarts.append)
    for started in ("1", "2", "1", "2", "3"):
        detector.consume("p", parse_families(f"process_start_time_seconds {started}\n"))
    assert restarts == ["p", "p"]  # 1 -> 2 and 2 -> 3


# ---- which engines are scraped: every pool whose policy needs load -------------------------

CONFIG = {
    "prefill": {"endpoints": ["127.0.0.1:1"]},
    "decode": {"endpoints": ["127.0.0.1:2"]},
    "kv_check": {"enabled": False},
}


def test_plan_covers_load_aware_pools_of_models_groups_and_kv_check() -> None:
    config = fixed_routing_config(
        CONFIG
        | {
            "kv_check": {"interval_s": 10},
            "models": {
                "m": {
                    "prefill": {"endpoints": ["127.0.0.1:3"]},
                    "decode": {
                        "endpoints": ["127.0.0.1:4"],
                        "policy": "power_of_two",
                        "load_interval_s": 0.5,
                    },
                }
            },
        }
    )
    members = {
        "": {"prefill": {"127.0.0.1:1"}, "decode": {"127.0.0.1:2"}},
        "m": {"prefill": {"127.0.0.1:3"}, "decode": {"127.0.0.1:4"}},
    }
    decodes = ["127.0.0.1:2", "127.0.0.1:4"]
    assert scrape_plan(config, members, decodes) == {"127.0.0.1:2": 10.0, "127.0.0.1:4": 0.5}


def test_plan_covers_pools_with_kv_events_for_restart_detection() -> None:
    config = fixed_routing_config(
        CONFIG
        | {
            "kv_check": {"enabled": False},
            "health": {"interval_s": 3},
            "decode": {"endpoints": ["127.0.0.1:2"], "kv_events": {}},
        }
    )
    members = {"": {"prefill": {"127.0.0.1:1"}, "decode": {"127.0.0.1:2"}}}
    assert scrape_plan(config, members, ["127.0.0.1:2"]) == {"127.0.0.1:2": 3.0}


async def scraped_runtime(config: dict[str, object]) -> Runtime:
    rt = Runtime(fixed_routing_config(config), "unix:/nonexistent")
    async with aiohttp.ClientSession() as session:
        rt._session = session  # the wiring's session, normally opened by start()
        await rt.scraper.scrape_due()
        rt._session = None
    return rt


async def test_power_of_two_pools_get_engine_load_and_others_do_not(engines: Engines) -> None:
    decode = {"endpoints": [engines.served, engines.missing], "policy": "power_of_two"}
    rt = await scraped_runtime(CONFIG | {"decode": decode})
    states = {s.address: s for s in rt.decode}
    assert (states[engines.served].waiting, states[engines.served].kv_usage) == (5.0, 0.375)
    assert (states[engines.missing].waiting, states[engines.missing].kv_usage) == (0.0, 0.0)
    assert engines.fetches == [engines.served]

    rt = await scraped_runtime(CONFIG | {"decode": decode | {"policy": "round_robin"}})
    assert [s.waiting for s in rt.decode] == [0.0, 0.0]  # nothing reads load: not scraped


async def test_power_of_two_in_a_models_group_sees_engine_load(engines: Engines) -> None:
    group = {
        "prefill": {"endpoints": ["127.0.0.1:3"]},
        "decode": {"endpoints": [engines.served, engines.missing], "policy": "power_of_two"},
    }
    rt = await scraped_runtime(CONFIG | {"models": {"m": group}})  # top level: round_robin
    model = rt.scheduler.group("m")
    picked = [
        rt.decode.pick(PickRequest(model="m"), model.members["decode"], model.pickers["decode"])
        for _ in range(20)
    ]
    # The served engine reports 5 waiting requests: two random choices always avoid it.
    assert {p.address for p in picked if p is not None} == {engines.missing}


def test_kv_check_closes_one_window_per_interval_however_often_scraped() -> None:
    kv_check = KvCheck(lambda: KvCheckConfig(interval_s=10), Metrics(), lambda a: a == "d")
    for moved in (90, 95):  # scraped again at once (its pool's policy reads engine load)
        page = VLLM_METRICS.replace("} 90.0", f"}} {moved}.0")
        kv_check.consume("d", parse_families(page))
        kv_check.consume("p", parse_families(page))  # not a decode engine
    [window] = kv_check.snapshot().values()  # "p" is not a decode engine: no window
    assert window["external_kv_transfer"] == 90.0 and window["share"] is None


def test_only_the_families_consumers_read_are_parsed() -> None:
    only = ("process_start_time_seconds", "vllm:num_requests_waiting")
    families = parse_families(VLLM_METRICS, only)
    assert set(families) == {*only, "vllm:num_requests_waiting_by_reason"}  # a prefix match
    assert families["process_start_time_seconds"].samples[0].value == 1.7e9


def test_each_data_parallel_engines_load_is_read_from_its_engine_label() -> None:
    page = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
"""
    assert rank_loads(parse_families(page)) == {0: 4.0, 1: 2.0}
    state = EndpointState("p")
    EngineLoad(lambda address: state).consume("p", parse_families(page))
    assert state.rank_load == {0: 4.0, 1: 2.0} and (state.waiting, state.running) == (3.0, 3.0)
    assert rank_loads(parse_families("vllm:num_requests_waiting 3.0\n")) == {}
    huge = 'vllm:num_requests_waiting{engine="99999999",model_name="m"} 1.0\n'
    with_huge = page.replace(
        "# TYPE vllm:num_requests_running", huge + "# TYPE vllm:num_requests_running"
    )
    assert rank_loads(parse_families(with_huge)) == {0: 4.0, 1: 2.0}  # ranks are bounded
    # our own requests at the scrape are not other routers' load (counted exactly elsewhere)
    state.rank_in_flight = {0: 3, 1: 5}
    changed: list[str] = []
    load = EngineLoad(lambda address: state, changed.append)
    load.consume("p", parse_families(page))
    assert state.rank_load == {0: 1.0, 1: 0.0}
    assert changed == []  # two ranks, as before
    load.consume("p", parse_families(page.replace('engine="1"', 'engine="0"')))
    assert changed == ["p"]  # one rank now: its KV event sources follow
