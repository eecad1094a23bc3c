"""KV-cache routing in `pd-extproc epp`, behind a gateway Envoy: the endpoint picker shares the
scheduler, so a prompt cached on one prefill engine goes there, as through the sidecar."""

from __future__ import annotations

import json
from pathlib import Path

from extproc.request.parse import Api
from extproc.testing import scrape
from tests.support.engines import free_port
from tests.support.epp import GatewayTopology, epp_topology
from tests.support.gateway import Variant
from tests.support.kv_routing import (
    completion_body,
    connecting_engine_flags,
    engine_flags,
    fallback_choice,
    kv_endpoint,
    loopback_events,
    model_dir,
    words,
)
from tests.support.topology import address, until

__all__ = ["loopback_events", "model_dir"]  # the fixtures, shared with the sidecar's tests


async def test_a_prompt_cached_on_one_prefill_goes_there_through_the_picker(
    model_dir: Path,
) -> None:
    kv = {"policy": "kv_cache", "kv_events": {}}
    async with epp_topology(
        Variant.OVERRIDE_HOST,
        2,
        1,
        engine_flags=engine_flags(model_dir),
        endpoint=kv_endpoint,
        prefill=kv,
        decode=kv,
        tokenizer=str(model_dir),
    ) as topo:
        shared = words(0, 120)
        body = completion_body(f"{shared} marker-e w7")
        elsewhere = fallback_choice(topo.prefills, Api.COMPLETIONS, body)
        holder = next(p for p in topo.prefills if address(p) != elsewhere)
        async with topo.session.post(
            holder.url + "/v1/completions",
            data=completion_body(f"{shared} w1 w2"),
            headers={"content-type": "application/json"},
        ) as response:
            assert response.status == 200
        applied = (
            f'pd_extproc_kv_event_batches_total{{endpoint="{address(holder)}",outcome="applied"}}'
        )

        async def indexed() -> bool:
            return (await scrape(topo.session, topo.picker.metrics + "/metrics")).get(
                applied, 0
            ) >= 1

        await until(indexed, "the holder's KV events applied")

        status, text, _ = await topo.post("/v1/completions", body)
        assert status == 200, text
        assert await prefills_that_saw(topo, "marker-e") == [address(holder)]


async def test_engines_that_connect_with_llm_ds_topic_are_indexed_through_the_picker(
    model_dir: Path,
) -> None:
    """llm-d's topology: every engine's publisher connects to the picker's listener with the
    topic `kv@<its address>@<model>`; a prompt cached on one prefill goes there."""
    port = free_port()
    kv = {"policy": "kv_cache", "kv_events": {"mode": "listen"}}
    async with epp_topology(
        Variant.OVERRIDE_HOST,
        2,
        1,
        engine_flags=connecting_engine_flags(model_dir, port),
        prefill=kv,
        decode=kv,
        tokenizer=str(model_dir),
        kv_listener={"port": port},
    ) as topo:
        shared = words(0, 120)
        body = completion_body(f"{shared} marker-l w7")
        elsewhere = fallback_choice(topo.prefills, Api.COMPLETIONS, body)
        holder = next(p for p in topo.prefills if address(p) != elsewhere)
        applied = (
            f'pd_extproc_kv_event_batches_total{{endpoint="{address(holder)}",outcome="applied"}}'
        )

        async def batches() -> float:
            page = await scrape(topo.session, topo.picker.metrics + "/metrics")
            return float(page.get(applied, 0))

        async def fill(prompt: str) -> None:
            async with topo.session.post(
                holder.url + "/v1/completions",
                data=completion_body(prompt),
                headers={"content-type": "application/json"},
            ) as response:
                assert response.status == 200

        tries = iter(range(1000))

        async def heard() -> bool:  # the publisher's first batches are lost while it joins
            await fill(words(300 + 8 * next(tries), 8))
            return await batches() > 0

        await until(heard, "the holder's KV events heard of")
        before = await batches()
        await fill(f"{shared} w1 w2")

        async def indexed() -> bool:
            return await batches() > before

        await until(indexed, "the holder's KV events applied")

        status, text, _ = await topo.post("/v1/completions", body)
        assert status == 200, text
        assert await prefills_that_saw(topo, "marker-l") == [address(holder)]


async def prefills_that_saw(topo: GatewayTopology, marker: str) -> list[str]:
    """The prefill engines a request whose body holds `marker` reached."""
    return [
        address(p)
        for p in topo.prefills
        if any(marker in json.dumps(r["body"]) for r in await topo.seen(p))
    ]
