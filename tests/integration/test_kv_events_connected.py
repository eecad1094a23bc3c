"""KV events in llm-d's topology, end to end (`pd-extproc up`, and `serve` beside its own
Envoy: real Envoy, the real ext_proc, vllmsim engines): every engine's publisher connects to
the sidecar's listener with the topic `kv@<its address>@<model>`, and a prompt cached on one
prefill goes there. A hostile publisher that connects too (topics naming no member, malformed
messages, oversized batches, a flood) indexes nothing, is counted, and never holds the
sidecar's event loop 0.25 s. With two ext_proc processes, both index the engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from extproc.request.parse import Api
from extproc.testing import scrape
from tests.support.engines import free_port
from tests.support.kv_routing import (
    completion_body,
    connecting_engine_flags,
    fallback_choice,
    loopback_events,
    model_dir,
    words,
)
from tests.support.split import split_topology
from tests.support.topology import Topology, address, topology, until
from vllmsim.launcher import EngineHandle

__all__ = ["loopback_events", "model_dir"]  # the fixtures, from tests/support

STALL_BOUND_S = 0.25


@contextlib.asynccontextmanager
async def connected(model_dir: Path, workers: int = 1) -> AsyncIterator[tuple[Topology, int]]:
    """2P1D whose engines connect to the sidecar's listener; the listener's port."""
    port = free_port()
    pool = {"policy": "kv_cache", "kv_events": {"mode": "listen"}}
    async with topology(
        2,
        1,
        engine_flags=connecting_engine_flags(model_dir, port),
        prefill=pool,
        decode=pool,
        tokenizer=str(model_dir),
        kv_listener={"port": port},
        extproc={"workers": workers},
    ) as topo:
        yield topo, port


async def metric(topo: Topology, name: str) -> float:
    """A sample of the sidecar's page; with several ext_proc processes, their sum (the page
    labels each process's samples with its `worker`)."""
    page = await topo.metrics()
    return sum(v for k, v in page.items() if k == name or k.startswith(f"{name[:-1]},worker="))


def applied(engine: EngineHandle) -> str:
    return f'pd_extproc_kv_event_batches_total{{endpoint="{address(engine)}",outcome="applied"}}'


async def send(topo: Topology, engine: EngineHandle, prompt: str) -> None:
    """A request sent to the engine itself (as another router would): it fills its cache."""
    async with topo.session.post(
        engine.url + "/v1/completions",
        data=completion_body(prompt),
        headers={"content-type": "application/json"},
    ) as response:
        assert response.status == 200, await response.text()


async def fill(topo: Topology, engine: EngineHandle, prompt: str) -> None:
    """`prompt` cached on the engine, and its events applied by the sidecar. A connecting
    publisher's first batches are lost while ZMQ joins it: prompts of their own are sent
    until one is heard of, then this one."""
    tries = iter(range(1000))

    async def heard() -> bool:
        await send(topo, engine, words(300 + 8 * next(tries), 8))
        return await metric(topo, applied(engine)) > 0

    await until(heard, f"KV events of {address(engine)} heard of")
    before = await metric(topo, applied(engine))
    await send(topo, engine, prompt)

    async def applied_since() -> bool:
        return await metric(topo, applied(engine)) > before

    await until(applied_since, f"KV events of {address(engine)} applied")


async def served(topo: Topology, marker: str) -> list[str]:
    return [
        address(e)
        for e in topo.prefills
        if any(marker in json.dumps(r["body"]) for r in await topo.seen(e))
    ]


async def test_engines_that_connect_with_llm_ds_topic_are_indexed_and_routed_by(
    model_dir: Path,
) -> None:
    async with connected(model_dir) as (topo, _):
        shared = words(0, 120)  # 30 blocks
        body = completion_body(f"{shared} marker-c w7")
        elsewhere = fallback_choice(topo.prefills, Api.COMPLETIONS, body)
        holder = next(p for p in topo.prefills if address(p) != elsewhere)
        await fill(topo, holder, f"{shared} w1 w2 w3")

        status, text, _ = await topo.post("/v1/completions", body)
        assert status == 200, text
        assert await served(topo, "marker-c") == [address(holder)]
        cached = await metric(topo, 'pd_extproc_kv_cached_prompt_tokens_total{role="prefill"}')
        assert cached == 120


async def test_every_ext_proc_process_indexes_the_engines_one_of_them_listens_for(
    model_dir: Path,
) -> None:
    """One process binds the port; with `extproc.workers: 2` the other reads what it relays,
    so both route by the same index."""
    async with connected(model_dir, workers=2) as (topo, _):
        holder = topo.prefills[0]
        await fill(topo, holder, f"{words(0, 40)} w1")
        [worker] = topo.sidecar.worker_metrics
        prompts = iter(range(1, 1000))

        async def in_the_worker() -> bool:
            page = await scrape(topo.session, worker + "/metrics")
            if page.get(applied(holder), 0) > 0:
                return True
            # the relay is PUB/SUB: what is relayed before the worker's subscription reaches
            # the main process is lost (ZMQ's slow joiner), so each try stores a prompt of new
            # words (new blocks: a new batch) on the engine
            await send(topo, holder, words(1 + 3 * next(prompts), 40))  # a new first word
            return False

        await until(in_the_worker, "the worker applied the holder's batches")
        assert "cannot listen" not in topo.sidecar.log_text()


async def longest_live(session: aiohttp.ClientSession, url: str, done: asyncio.Event) -> float:
    """The longest /live answer while `done` is not set: how long the event loop was held."""
    worst = 0.0
    while not done.is_set():
        before = time.perf_counter()
        async with session.get(url + "/live") as response:
            assert response.status == 200
        worst = max(worst, time.perf_counter() - before)
        await asyncio.sleep(0.01)
    return worst


async def test_a_hostile_publisher_that_connects_indexes_nothing_and_stalls_nothing(
    model_dir: Path,
) -> None:
    async with connected(model_dir) as (topo, port):
        holder = topo.prefills[0]
        await fill(topo, holder, f"{words(0, 40)} w1")
        ctx = zmq.asyncio.Context()
        hostile = ctx.socket(zmq.PUB)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.setsockopt(zmq.SNDHWM, 100_000)
        hostile.connect(f"tcp://127.0.0.1:{port}")
        done = asyncio.Event()
        live = asyncio.create_task(longest_live(topo.session, topo.sidecar.metrics, done))
        try:
            stored = {
                "type": "BlockStored",
                "block_hashes": [7, 8],
                "parent_block_hash": None,
                "token_ids": list(range(8)),
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
            big = msgpack.packb([1.0, [stored] * 30_000, 0])  # a few MB of blocks
            seq = 0
            for _ in range(20):
                for topic in (b"kv@10.6.6.6@sim-model", b"kv@127.0.0.1:1@sim-model"):
                    await hostile.send_multipart([topic, seq.to_bytes(8, "big"), big])
                    seq += 1
            for _ in range(3000):
                await hostile.send_multipart([b"kv@10.6.6.6@m", b"x"])
                await hostile.send_multipart([b"junk", seq.to_bytes(8, "big"), b"\xc1"])
                seq += 1
            # a member's own topic: large batches, applied in slices, and an oversized one
            # (its entries go, as for a gap)
            member = f"kv@{address(holder)}@sim-model".encode()
            many = msgpack.packb(
                [
                    1.0,
                    [
                        stored | {"block_hashes": [10**6 + 2 * i, 10**6 + 2 * i + 1]}
                        for i in range(30_000)
                    ],
                    0,
                ]
            )
            for n in range(3):
                await hostile.send_multipart([member, (10**6 + n).to_bytes(8, "big"), many])
            await hostile.send_multipart(
                [member, (10**6 + 3).to_bytes(8, "big"), b"\0" * (9 << 20)]
            )

            async def counted() -> bool:
                page = await topo.metrics()
                return (
                    page.get('pd_extproc_kv_event_unattributed_total{reason="unknown_topic"}', 0)
                    >= 20
                    and page.get('pd_extproc_kv_event_unattributed_total{reason="malformed"}', 0)
                    >= 20
                    and page.get(
                        "pd_extproc_kv_event_batches_total"
                        f'{{endpoint="{address(holder)}",outcome="oversized"}}',
                        0,
                    )
                    >= 1
                )

            await until(counted, "the hostile messages counted", 40)
        finally:
            done.set()
            worst = await live
            hostile.close(linger=0)
            ctx.term()
        print(f"longest /live answer under the hostile publisher: {worst * 1000:.0f} ms")
        assert worst < STALL_BOUND_S, worst
        page = await topo.metrics()
        engines = {
            key.split('endpoint="')[1].split('"')[0]
            for key in page
            if key.startswith("pd_extproc_kv_event_batches_total{")
        }
        assert engines <= {address(e) for e in topo.engines}  # no engine of the attacker's
        # the engines' streams live on: the holder is indexed again from its next batches
        await fill(topo, holder, f"{words(100, 40)} w2")


async def test_serve_indexes_engines_that_connect_and_routes_by_what_they_hold(
    model_dir: Path,
) -> None:
    """`pd-extproc serve` beside its own Envoy: the same listener, the same index."""
    port = free_port()
    async with (
        split_topology(
            engine_flags=connecting_engine_flags(model_dir, port),
            pool={"policy": "kv_cache", "kv_events": {"mode": "listen"}},
            tokenizer=str(model_dir),
            kv_listener={"port": port},
        ) as split,
        aiohttp.ClientSession() as session,
    ):
        prefill = split.cfg.prefill.endpoints[0].address

        async def page() -> dict[str, float]:
            return await scrape(session, split.metrics + "/metrics")

        async def send(prompt: str) -> None:
            async with session.post(
                f"http://{prefill}/v1/completions", data=completion_body(prompt)
            ) as response:
                assert response.status == 200

        name = f'pd_extproc_kv_event_batches_total{{endpoint="{prefill}",outcome="applied"}}'
        tries = iter(range(1000))

        async def heard() -> bool:
            await send(words(300 + 8 * next(tries), 8))
            return (await page()).get(name, 0) > 0

        await until(heard, "the prefill's KV events heard of")
        before = (await page()).get(name, 0)
        shared = words(0, 120)
        await send(f"{shared} w1 w2")

        async def applied_since() -> bool:
            return (await page()).get(name, 0) > before

        await until(applied_since, "the prefill's KV events applied")
        async with session.post(
            split.url + "/v1/completions", data=completion_body(f"{shared} marker-v w7")
        ) as response:
            assert response.status == 200, await response.text()
        cached = (await page()).get('pd_extproc_kv_cached_prompt_tokens_total{role="prefill"}')
        assert cached == 120
