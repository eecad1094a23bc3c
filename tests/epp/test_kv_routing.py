"""KV-cache routing in `pd-extproc epp`, behind a gateway Envoy: the endpoint picker shares the
scheduler, so a prompt cached on one prefill engine goes there, as through the sidecar."""

from __future__ import annotations

import json
from pathlib import Path

from extproc.request.parse import Api
from extproc.testing import scrape
from tests.epp.conftest import epp_topology
from tests.epp.gateway import Variant
from tests.integration.conftest import address, until
from tests.integration.test_kv_routing import (
    completion_body,
    engine_flags,
    fallback_choice,
    kv_endpoint,
    loopback_events,
    model_dir,
    words,
)

__all__ = ["loopback_events", "model_dir"]  # the fixtures, shared with the sidecar's tests


async def test_a_prompt_cached_on_one_prefill_goes_there_through_the_picker(
    model_dir: Path,
) -> None:
    kv = {"policy": "kv_cache", "kv_events": {}}
    async with epp_topology(Variant.OVERRIDE_HOST, 2, 1, engine_flags=engine_flags(model_dir),
                            endpoint=kv_endpoint, prefill=kv, decode=kv,
                            tokenizer=str(model_dir)) as topo:  # fmt: skip
        shared = words(0, 120)
        body = completion_body(f"{shared} marker-e w7")
        elsewhere = fallback_choice(topo.prefills, Api.COMPLETIONS, body)
        holder = next(p for p in topo.prefills if address(p) != elsewhere)
        async with topo.session.post(holder.url + "/v1/completions",
                                     data=completion_body(f"{shared} w1 w2"),
                                     headers={"content-type": "application/json"}) as response:
            assert response.status == 200
        applied = (f'pd_extproc_kv_event_batches_total{{endpoint="{address(holder)}",'
                   'outcome="applied"}')

        async def indexed() -> bool:
            return (await scrape(topo.session, topo.picker.metrics + "/metrics")).get(
                applied, 0) >= 1  # fmt: skip
        await until(indexed, "the holder's KV events applied")

        status, text, _ = await topo.post("/v1/completions", body)
        assert status == 200, text
        got = [address(p) for p in topo.prefills
               if any("marker-e" in json.dumps(r["body"]) for r in await topo.seen(p))]
        assert got == [address(holder)]

