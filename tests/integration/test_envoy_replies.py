"""Envoy's own error replies through the real Envoy: the OpenAI-style JSON `code` is the HTTP
status, and the message says what happened (a timeout is not called "unavailable")."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson

from extproc.bootstrap.render import render_bootstrap, render_yaml
from extproc.config import parse_config
from extproc.process.envoy_process import EnvoyProcess
from tests.support.engines import MODEL
from tests.support.split import split_topology

COMPLETION = {"model": MODEL, "prompt": "a reply from Envoy itself " * 20, "max_tokens": 2}


async def post(url: str, prompt: str = COMPLETION["prompt"]) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/completions",
            json={**COMPLETION, "prompt": prompt},
            timeout=aiohttp.ClientTimeout(total=20),
        ) as response,
    ):
        return response.status, orjson.loads(await response.read())


@contextlib.asynccontextmanager
async def envoy_without_its_extproc(tmp: Path) -> AsyncIterator[str]:
    """The rendered Envoy with the ext_proc's port closed (bound, never listening)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        extproc = f"127.0.0.1:{closed.getsockname()[1]}"
        cfg = parse_config(
            {
                "prefill": {"endpoints": ["127.0.0.1:9"]},
                "decode": {"endpoints": ["127.0.0.1:11"]},
                "envoy": {"listen": {"port": 0}},
            }
        )
        bootstrap = render_bootstrap(cfg, extproc, f"unix:{tmp / 'prefill.sock'}")
        (tmp / "envoy.yaml").write_text(render_yaml(bootstrap))
        envoy = EnvoyProcess(tmp / "envoy.yaml", tmp, "warning", 1)
        await envoy.start()
        try:
            yield "http://" + await envoy.listener_address("ingress")
        finally:
            await envoy.stop()


async def test_extproc_message_timeout_is_a_504_with_code_504() -> None:
    # Envoy times a buffered body's message (a streamed one is timed by the ext_proc itself):
    # 1 ms, against the tens of milliseconds the ext_proc takes to read a 4 MB body
    timeouts = {"extproc_message_s": 0.001}
    async with split_topology(buffered=True, timeouts=timeouts) as split:  # type: ignore[arg-type]
        status, body = await post(split.url, "large " * 700_000)
    assert status == 504, body
    assert body["error"]["code"] == 504 and body["error"]["type"] == "GatewayTimeout", body
    assert "did not answer within its message timeout" in body["error"]["message"], body


async def test_extproc_unreachable_is_a_503_with_code_503(tmp_path: Path) -> None:
    async with envoy_without_its_extproc(tmp_path) as url:
        status, body = await post(url)
    assert status == 503, body
    assert body["error"]["code"] == 503, body
    assert body["error"]["message"] == "the pd-extproc ext_proc is unavailable; retry", body
