"""Each engine's context length as its /v1/models says it: read once it is healthy, forgotten
when it goes down, restarts or leaves; what the health checker's rounds feed it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from extproc.config import parse_config
from extproc.engines.context import ContextLengths, served_context
from extproc.wiring import Runtime


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """An engine on 127.0.0.1: /health, and /v1/models answering what the test puts in the
    dict (`"status"`: its HTTP status); it counts the /v1/models asked."""
    served: dict[str, Any] = {"asked": 0}

    async def models(request: web.Request) -> web.Response:
        served["asked"] += 1
        page = {k: v for k, v in served.items() if k not in ("asked", "status")}
        return web.json_response({"data": [page]}, status=served.get("status", 200))

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=served.get("status", 200))

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"127.0.0.1:{runner.addresses[0][1]}", served
    await runner.cleanup()


@pytest.mark.parametrize(
    ("page", "learned"),
    [
        ({"id": "m", "max_model_len": 8192}, 8192),
        ({"id": "m"}, None),
        ({"id": "m", "max_model_len": "8192"}, None),
        ({"id": "m", "max_model_len": 8192, "status": 500}, None),
    ],
    ids=["vllm", "not-said", "a-string", "an-error"],
)
async def test_the_context_length_is_what_the_engine_says(
    engine: tuple[str, dict[str, Any]], page: dict[str, Any], learned: int | None
) -> None:
    address, served = engine
    served.update(page)
    async with aiohttp.ClientSession() as session:
        assert await served_context(session, address, 5.0, {}) == learned


async def test_an_engine_is_asked_once_per_healthy_spell(
    engine: tuple[str, dict[str, Any]],
) -> None:
    address, served = engine
    served.update({"id": "m", "max_model_len": 4096})
    told: dict[str, int | None] = {}
    lengths = ContextLengths(
        told.__setitem__, lambda session, a: served_context(session, a, 5.0, {})
    )
    async with aiohttp.ClientSession() as session:
        await lengths.health(session, address, True)
        await lengths.health(session, address, True)
        assert (told, served["asked"]) == ({address: 4096}, 1)
        await lengths.health(session, address, False)  # down: it may come back otherwise
        assert told == {address: None}
        served["max_model_len"] = 8192
        await lengths.health(session, address, True)
        assert (told, served["asked"]) == ({address: 8192}, 2)
        lengths.forget(address)  # restarted, or left its pool
        assert told == {address: None}


async def test_a_health_round_learns_every_engines_length_decodes_too(
    engine: tuple[str, dict[str, Any]],
) -> None:
    """Decode engines are not probed: the health checker's round asks them."""
    address, served = engine
    served.update({"id": "m", "max_model_len": 2048})
    config = {"prefill": {"endpoints": ["127.0.0.1:1"]}, "decode": {"endpoints": [address]}}
    rt = Runtime(parse_config(config | {"dispatch": {"probe": False}}), "unix:/x")
    async with aiohttp.ClientSession() as session:
        rt.health._session = session  # as start() sets it, without the background loop
        await rt.health.check_all(unhealthy_after=1)
    assert rt.kv.fit_limit([address]) == 2048
    assert rt.kv.fit_limit([address, "127.0.0.1:1"]) is None  # P is down: it has not said
