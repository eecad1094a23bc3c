"""The identity probe's reading of an engine's /v1/models: the model it serves and, where the
engine says it (vLLM's `max_model_len`), the longest prompt it runs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from extproc.engines.probe import _served_model


@pytest.fixture
async def models_page() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """An engine's /v1/models on 127.0.0.1, answering what the test puts in the dict."""
    served: dict[str, Any] = {}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [served]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"127.0.0.1:{runner.addresses[0][1]}", served
    await runner.cleanup()


@pytest.mark.parametrize(
    ("length", "learned"),
    [(8192, 8192), (None, None), (0, None), ("8192", None), (True, None)],
    ids=["vllm", "not-said", "zero", "a-string", "a-boolean"],
)
async def test_the_context_length_is_read_where_the_engine_says_it(
    models_page: tuple[str, dict[str, Any]], length: object, learned: int | None
) -> None:
    address, served = models_page
    served.update({"id": "m", "object": "model"})
    if length is not None:
        served["max_model_len"] = length
    async with aiohttp.ClientSession() as session:
        assert await _served_model(session, address, 5.0, {}) == ("m", learned, ["m"])


async def test_every_name_of_the_base_model_is_read_and_no_adapter() -> None:
    """vLLM's /v1/models with `--served-model-name m alias` and a LoRA adapter: the metrics
    name only `m`, yet vLLM keys a request for `alias` as the base model's."""
    page = {
        "object": "list",
        "data": [
            {"id": "m", "object": "model", "parent": None, "max_model_len": 4096},
            {"id": "alias", "object": "model", "parent": None},
            {"id": "m-lora", "object": "model", "parent": "m"},
        ],
    }

    async def models(request: web.Request) -> web.Response:
        return web.json_response(page)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        address = f"127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as session:
            assert await _served_model(session, address, 5.0, {}) == ("m", 4096, ["m", "alias"])
    finally:
        await runner.cleanup()
