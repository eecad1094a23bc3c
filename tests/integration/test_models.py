"""Several models behind one sidecar: each model name goes to its own prefill and decode pools."""

from __future__ import annotations

import asyncio

import aiohttp

from extproc.testing import ephemeral_config, running_sidecar
from tests.support.engines import address
from tests.support.topology import Topology
from vllmsim.launcher import PUSH_D, PUSH_P, running_engine


async def test_each_model_uses_its_own_pools() -> None:
    def engine(connector: str, model: str):
        return running_engine("--kv-transfer-config", connector, "--served-model-name", model)

    async with (
        engine(PUSH_P, "model-a") as pa,
        engine(PUSH_D, "model-a") as da,
        engine(PUSH_P, "model-b") as pb,
        engine(PUSH_D, "model-b") as db,
    ):
        config = ephemeral_config([address(pa)], [address(da)])  # the default group: model-a
        config["models"] = {
            "model-b": {
                "prefill": {"endpoints": [address(pb)]},
                "decode": {"endpoints": [address(db)]},
            }
        }
        async with running_sidecar(config) as sidecar, aiohttp.ClientSession() as session:
            topo = Topology([pa, pb], [da, db], sidecar, session)
            for model in ["model-a", "model-b"] * 3:
                body = {"model": model, "prompt": f"for {model} " * 5, "max_tokens": 2}
                status, text, _ = await topo.post("/v1/completions", body)
                assert status == 200, text
            await asyncio.sleep(0)
            for engine_handle, model in (
                (pa, "model-a"),
                (da, "model-a"),
                (pb, "model-b"),
                (db, "model-b"),
            ):
                seen = await topo.seen(engine_handle)
                assert len(seen) == 3 and {r["body"]["model"] for r in seen} == {model}
            # the probes learned both prefills and completed their transfers on the right model
            identities = (await topo.ready())["identities"]
            assert identities[address(pa)]["engine_id"] and identities[address(pb)]["engine_id"]
            for d in (da, db):
                records = await topo.seen(d)
                assert all(r["status"] == 200 for r in records)
