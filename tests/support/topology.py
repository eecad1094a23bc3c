"""A real topology: vllmsim engines, Envoy and the ext_proc, all as processes on ephemeral
loopback ports, and what a test asks of it (post, what each engine saw, metrics, /ready)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from extproc.testing import (
    SidecarHandle,
    ephemeral_config,
    fixed_routing,
    running_sidecar,
    scrape,
)
from tests.support.engines import (
    MODEL,
    PULL,
    PUSH,
    address,
    clear_engines,
    engine_requests,
    start_engines,
)
from tests.support.polling import until
from vllmsim.launcher import EngineHandle

# A topology test's whole vocabulary from one module (the engines' and polling names too)
__all__ = [
    "MODEL",
    "PULL",
    "PUSH",
    "Topology",
    "address",
    "generated_text",
    "identity_events",
    "requests_total",
    "topology",
    "until",
]


@dataclass
class Topology:
    prefills: list[EngineHandle]
    decodes: list[EngineHandle]
    sidecar: SidecarHandle
    session: aiohttp.ClientSession
    engines_by_address: dict[str, EngineHandle] = field(default_factory=dict)

    @property
    def engines(self) -> list[EngineHandle]:
        return [*self.prefills, *self.decodes]

    async def post(
        self, path: str, body: dict[str, Any] | bytes, **kwargs: Any
    ) -> tuple[int, bytes, CIMultiDict[str]]:
        """POST a dict as JSON (aiohttp escapes non-ASCII), or bytes exactly as they are."""
        if isinstance(body, bytes):
            kwargs["data"] = body
            kwargs["headers"] = {"content-type": "application/json", **kwargs.get("headers", {})}
        else:
            kwargs["json"] = body
        async with self.session.post(
            self.sidecar.url + path,
            timeout=aiohttp.ClientTimeout(total=kwargs.pop("timeout", 30)),
            **kwargs,
        ) as response:
            return response.status, await response.read(), CIMultiDict(response.headers)

    async def seen(self, engine: EngineHandle) -> list[dict[str, Any]]:
        """What `engine` received (vllmsim's request log), probes excluded."""
        return await engine_requests(self.session, engine)

    async def clear(self) -> None:
        await clear_engines(self.session, self.engines)

    async def metrics(self) -> dict[str, float]:
        """The sidecar's metrics once every finished request has been counted.

        A request is counted when Envoy closes its ext_proc stream, just after the client
        got the answer, or, for an answer that started, when Envoy's access-log entry for it
        arrives; waiting for no open stream and no awaited entry avoids reading too early.
        """
        for _ in range(100):
            ready = await self.ready()
            if ready["active_streams"] == 0 and ready.get("awaiting_access_log", 0) == 0:
                break
            await asyncio.sleep(0.02)
        return await scrape(self.session, self.sidecar.metrics + "/metrics")

    async def released(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """/ready once no endpoint has a request in flight (bounded).

        The sidecar releases a request's counts when Envoy closes its stream, which can come
        just after an engine has seen the request end.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            ready = await self.ready()
            counts = [e["in_flight"] for r in ("prefill", "decode") for e in ready[r].values()]
            if not any(counts) or asyncio.get_running_loop().time() > deadline:
                return ready
            await asyncio.sleep(0.02)

    async def ready(self) -> dict[str, Any]:
        async with self.session.get(self.sidecar.metrics + "/ready?verbose") as response:
            return await response.json()

    async def aggregated(self, path: str, body: dict[str, Any]) -> str:
        """The text a decode engine generates for `body` on its own (no kv_transfer_params:
        it prefills locally), to compare a disaggregated answer with. vllmsim derives every
        answer from the KV the engine holds, so only a correct transfer gives the same text."""
        engine = self.decodes[0]
        async with self.session.post(engine.url + path, json=body) as response:
            assert response.status == 200, await response.text()
            return generated_text(path, await response.read())

    async def sim(self, engine: EngineHandle, method: str, path: str, body: Any = None) -> Any:
        async with self.session.request(method, engine.url + path, json=body) as response:
            return await response.json()


def generated_text(path: str, payload: bytes) -> str:
    """The generated text of a completion or chat answer, whole or streamed (SSE)."""
    chat = path.endswith("/chat/completions")
    if not payload.startswith(b"data: "):
        choice = orjson.loads(payload)["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])
    text = []
    for event in payload.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        for choice in orjson.loads(event.removeprefix(b"data: "))["choices"]:
            text.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(text)


def requests_total(outcome: str, reason: str, strategy: str, model: str = MODEL) -> str:
    """The sample name of pd_extproc_requests_total for these labels (as `scrape` keys it)."""
    return (
        f'pd_extproc_requests_total{{model="{model}",outcome="{outcome}",reason="{reason}",'
        f'strategy="{strategy}"}}'
    )


def identity_events(endpoint: str, event: str) -> str:
    return f'pd_extproc_identity_events_total{{endpoint="{endpoint}",event="{event}"}}'


@contextlib.asynccontextmanager
async def topology(
    n_prefill: int = 1,
    n_decode: int = 1,
    connectors: tuple[str, str] = PUSH,
    engine_flags: Sequence[str] | Callable[[], Sequence[str]] = (),
    extra_prefills: Sequence[EngineHandle] = (),
    endpoint: Callable[[EngineHandle], Any] = address,
    default_policy: bool = False,
    **config: Any,
) -> AsyncIterator[Topology]:
    """`endpoint`: an engine's entry in its pool's `endpoints` (its address, or a mapping).
    Routing is round robin without the decision unless stated (`fixed_routing`);
    `default_policy` leaves a pool that names no policy on the product's default."""
    async with contextlib.AsyncExitStack() as stack:
        prefills = await start_engines(stack, n_prefill, connectors[0], engine_flags)
        prefills += extra_prefills
        decodes = await start_engines(stack, n_decode, connectors[1], engine_flags)
        # `prefill=` / `decode=` sections (a policy and its options) join the endpoints
        pools = {
            role: {"endpoints": [endpoint(e) for e in engines], **config.pop(role, {})}
            for role, engines in (("prefill", prefills), ("decode", decodes))
        }
        cfg = (
            ephemeral_config(
                [address(e) for e in prefills], [address(e) for e in decodes], **config
            )
            | pools
        )
        routed = fixed_routing(cfg, pools=not default_policy)
        sidecar = await stack.enter_async_context(running_sidecar(routed))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        topo = Topology(prefills, decodes, sidecar, session)
        topo.engines_by_address = {address(e): e for e in topo.engines}
        yield topo
