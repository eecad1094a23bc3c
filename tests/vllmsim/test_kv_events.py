"""KV events as vLLM's --kv-events-config publishes them: ZMQ PUB frames (topic, sequence
number, msgpack KVEventBatch), one batch per step, the replay socket, and a restart."""

from __future__ import annotations

import hashlib
import pickle
import subprocess
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq

from tests.support.engines import two_free_ports
from tests.vllmsim.kv_event_helpers import (
    LOOPBACK_ENV,
    Subscriber,
    events_flag,
    events_of,
    replay,
    subscriber,
)
from tests.vllmsim.vsim_helpers import post
from vllmsim import kv_events
from vllmsim.launcher import FAST, EngineHandle, running_engine, vllmsim_command


def tokens(first: int, n: int) -> list[int]:
    return [first, *range(1000, 1000 + n - 1)]


async def complete(http: aiohttp.ClientSession, eng: EngineHandle, prompt: list[int]) -> Any:
    status, body = await post(
        http, eng, "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    )
    assert status == 200, body
    return body


async def first_batch(
    http: aiohttp.ClientSession, eng: EngineHandle, sub: Subscriber
) -> tuple[int, list[Any]]:
    """ZMQ drops what a PUB sends before the subscription arrives: send new prompts until one
    batch gets through."""
    for first in range(1, 60):
        await complete(http, eng, tokens(first, 40))
        if (got := sub.next(timeout=0.2)) is not None:
            assert got[0] == b"kv"
            return got[1], got[2]
    raise AssertionError("no KV event batch reached the subscriber")


def full_hash(parent: bytes, ids: list[int]) -> bytes:
    """vLLM's default block hash: sha256 over the pickled (parent, ids, extra keys)."""
    return hashlib.sha256(pickle.dumps((parent, tuple(ids), None), protocol=5)).digest()


def vllm_hash(parent: bytes, ids: list[int]) -> int:
    """The block hash as an event carries it (the low 64 bits)."""
    return int.from_bytes(full_hash(parent, ids), "big") & (2**64 - 1)


async def test_batches_carry_vllm_chain_hashes_in_sequence(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, *events_flag(), env=LOOPBACK_ENV) as eng:
        assert eng.kv_events_endpoint is not None
        assert eng.kv_events_endpoint.startswith("tcp://127.0.0.1:")
        with subscriber(eng.kv_events_endpoint) as sub:
            seq, _ = await first_batch(http, eng, sub)
            prompt = tokens(500, 40)  # 2 full blocks and a partial one
            await complete(http, eng, prompt)
            got = sub.next()
            assert got is not None and got[1] == seq + 1  # the next batch, no gap
            batch = got[2]
            assert isinstance(batch[0], float) and batch[2] == 0  # [ts, events, dp rank]
            [stored] = events_of(batch, "BlockStored")
            root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
            first = full_hash(root, prompt[:16])
            assert stored == {
                "type": "BlockStored",
                "block_hashes": [vllm_hash(root, prompt[:16]), vllm_hash(first, prompt[16:32])],
                "parent_block_hash": None,
                "token_ids": prompt[:32],
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            }
            # A prompt sharing the two blocks and adding one: only the new block is stored,
            # chained to the cached one.
            longer = [*prompt[:32], *range(7000, 7017)]
            await complete(http, eng, longer)
            got = sub.next()
            assert got is not None and got[1] == seq + 2
            [more] = events_of(got[2], "BlockStored")
            assert more["parent_block_hash"] == stored["block_hashes"][1]
            assert more["token_ids"] == longer[32:48] and len(more["block_hashes"]) == 1


async def test_replay_returns_buffered_batches_then_the_end_marker(
    http: aiohttp.ClientSession,
) -> None:
    async with running_engine(*FAST, *events_flag(buffer_steps=3), env=LOOPBACK_ENV) as eng:
        assert eng.kv_events_replay_endpoint is not None
        for first in range(1, 6):  # five batches: the buffer keeps the last three
            await complete(http, eng, tokens(first, 40))
        got = replay(eng.kv_events_replay_endpoint, 0)
        assert [seq for _, seq, _ in got] == [2, 3, 4]
        assert all(topic == b"kv" for topic, _, _ in got)
        last = msgpack.unpackb(got[-1][2])
        assert events_of(last, "BlockStored")[0]["token_ids"][0] == 5
        assert [seq for _, seq, _ in replay(eng.kv_events_replay_endpoint, 4)] == [4]
        assert replay(eng.kv_events_replay_endpoint, 9) == []


async def test_restart_starts_the_sequence_again_with_an_empty_cache(
    http: aiohttp.ClientSession,
) -> None:
    async with running_engine(*FAST, *events_flag(), env=LOOPBACK_ENV) as eng:
        assert eng.kv_events_replay_endpoint is not None
        prompt = tokens(42, 40)
        for first in range(1, 4):
            await complete(http, eng, tokens(first, 40))
        await complete(http, eng, prompt)
        assert [s for _, s, _ in replay(eng.kv_events_replay_endpoint, 0)] == [0, 1, 2, 3]
        async with http.post(eng.url + "/sim/restart", json={}) as resp:
            assert resp.status == 200
        assert replay(eng.kv_events_replay_endpoint, 0) == []  # a new process: nothing kept
        body = await complete(http, eng, prompt)  # the new engine holds nothing: stored again
        [(_, seq, payload)] = replay(eng.kv_events_replay_endpoint, 0)
        batch = msgpack.unpackb(payload)
        assert seq == 0 and [e["type"] for e in batch[1]] == ["BlockStored"]  # no AllBlocksCleared
        assert events_of(batch, "BlockStored")[0]["token_ids"] == prompt[:32]
        assert body["usage"]["prompt_tokens"] == 40


async def test_eviction_is_published_as_block_removed(http: aiohttp.ClientSession) -> None:
    # 8 blocks: A (64 tokens + 16 to generate) takes 5 and leaves 4 cached; B's 5 evict one.
    async with running_engine(
        *FAST, "--num-gpu-blocks", "8", *events_flag(), env=LOOPBACK_ENV
    ) as eng:
        assert eng.kv_events_replay_endpoint is not None
        a, b = tokens(1, 64), tokens(2, 64)
        for prompt in (a, b):
            await post(http, eng, "/v1/completions", {"prompt": prompt, "max_tokens": 16})
        batches = [msgpack.unpackb(p) for _, _, p in replay(eng.kv_events_replay_endpoint, 0)]
        stored = [e for batch in batches for e in events_of(batch, "BlockStored")]
        removed = [
            h
            for batch in batches
            for e in events_of(batch, "BlockRemoved")
            for h in e["block_hashes"]
        ]
        a_hashes = stored[0]["block_hashes"]
        assert len(a_hashes) == 4
        assert removed == [a_hashes[3]]  # the tail block of the least recently used prompt


def test_bad_kv_events_config_is_one_line() -> None:
    proc = subprocess.run(
        [*vllmsim_command(), "--kv-events-config", '{"endpoint": 5}'],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "vllmsim: error: --kv-events-config: endpoint must be a string"


async def test_block_size_sets_the_blocks_hashed(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, "--block-size", "32", *events_flag(), env=LOOPBACK_ENV) as eng:
        assert eng.kv_events_replay_endpoint is not None
        prompt = tokens(9, 70)  # two full 32-token blocks
        await complete(http, eng, prompt)
        [(_, _, payload)] = replay(eng.kv_events_replay_endpoint, 0)
        [stored] = events_of(msgpack.unpackb(payload), "BlockStored")
        root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
        assert stored["block_size"] == 32 and stored["token_ids"] == prompt[:64]
        assert stored["block_hashes"] == [
            vllm_hash(root, prompt[:32]),
            vllm_hash(full_hash(root, prompt[:32]), prompt[32:64]),
        ]


async def on_rank(
    http: aiohttp.ClientSession, eng: EngineHandle, prompt: list[int], rank: int
) -> None:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    headers = {"X-data-parallel-rank": str(rank)}
    async with http.post(eng.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()


async def test_each_data_parallel_rank_publishes_on_its_own_ports_with_its_rank(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM's per-rank publishers: the endpoints' ports plus the rank, the rank in the batch."""
    pub, rep = two_free_ports(), two_free_ports()
    flag = events_flag(endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://127.0.0.1:{rep}")
    async with running_engine(*FAST, "-dp", "2", *flag, env=LOOPBACK_ENV) as eng:
        assert [(r["kv_events_endpoint"], r["kv_events_replay_endpoint"]) for r in eng.ranks] == [
            (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"),
            (f"tcp://127.0.0.1:{pub + 1}", f"tcp://127.0.0.1:{rep + 1}"),
        ]
        prompt = tokens(77, 40)
        await on_rank(http, eng, prompt, 1)
        assert replay(f"tcp://127.0.0.1:{rep}", 0) == []  # rank 0 computed nothing
        [(_, seq, payload)] = replay(f"tcp://127.0.0.1:{rep + 1}", 0)
        batch = msgpack.unpackb(payload)
        assert seq == 0 and batch[2] == 1
        assert events_of(batch, "BlockStored")[0]["token_ids"] == prompt[:32]
        with subscriber(f"tcp://127.0.0.1:{pub + 1}") as sub:  # the live socket is rank 1's too
            got = None
            for first in range(1, 60):
                await on_rank(http, eng, tokens(first, 40), 1)
                if (got := sub.next(timeout=0.2)) is not None:
                    break
            assert got is not None and got[2][2] == 1


def scoped_hash(parent: bytes, ids: list[int], extra_keys: tuple[str, ...] | None) -> bytes:
    return hashlib.sha256(pickle.dumps((parent, tuple(ids), extra_keys), protocol=5)).digest()


async def test_salted_and_adapter_blocks_carry_their_extra_keys_as_vllms_do(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM's extra keys: the adapter's name on every block, the salt on the first block only;
    the hashes cover them (so each differs from the plain prompt's) and BlockStored carries
    them per block, with the adapter's name and id."""
    lora = ("--enable-lora", "--lora-modules", "sim-lora=/adapters/sim-lora")
    async with running_engine(*FAST, *lora, *events_flag(), env=LOOPBACK_ENV) as eng:
        assert eng.kv_events_endpoint is not None
        with subscriber(eng.kv_events_endpoint) as sub:
            await first_batch(http, eng, sub)
            root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
            prompt = tokens(600, 40)  # 2 full blocks
            stored = {}
            for name, extra in (
                ("salted", {"cache_salt": "s"}),
                ("adapter", {"model": "sim-lora", "cache_salt": "s"}),
            ):
                body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2, **extra}
                status, _ = await post(http, eng, "/v1/completions", body)
                assert status == 200
                got = sub.next()
                assert got is not None
                [stored[name]] = events_of(got[2], "BlockStored")
    first = scoped_hash(root, prompt[:16], ("s",))
    second = scoped_hash(first, prompt[16:32], None)
    assert stored["salted"]["block_hashes"] == [vllm_low(first), vllm_low(second)]
    assert stored["salted"]["extra_keys"] == [["s"], None]
    assert (stored["salted"]["lora_name"], stored["salted"]["lora_id"]) == (None, None)
    first = scoped_hash(root, prompt[:16], ("sim-lora", "s"))
    second = scoped_hash(first, prompt[16:32], ("sim-lora",))
    assert stored["adapter"]["block_hashes"] == [vllm_low(first), vllm_low(second)]
    assert stored["adapter"]["extra_keys"] == [["sim-lora", "s"], ["sim-lora"]]
    assert (stored["adapter"]["lora_name"], stored["adapter"]["lora_id"]) == ("sim-lora", 1)


def vllm_low(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & (2**64 - 1)


async def test_port_zero_gives_the_ranks_consecutive_ports_it_reports() -> None:
    """Simulator-only: a caller that cannot reserve ports lets the engine bind them and reads
    them back; a subscriber still finds rank r at rank 0's port plus r."""
    flag = events_flag(endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    async with running_engine(*FAST, "-dp", "3", *flag, env=LOOPBACK_ENV) as eng:
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            ports = [int(str(r[key]).rpartition(":")[2]) for r in eng.ranks]
            assert ports[0] > 0 and ports == [ports[0], ports[0] + 1, ports[0] + 2], key


async def test_a_taken_port_after_rank_zeros_moves_every_rank_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    taken: list[int] = []

    def publisher(cfg: kv_events.KVEventsConfig, rank: int = 0) -> kv_events.EventPublisher:
        if rank == 1 and not taken:  # the first try finds rank 1's port taken
            taken.append(rank)
            raise kv_events.KVEventsSocketError("Address already in use")
        return real(cfg, rank)

    real = kv_events.EventPublisher
    monkeypatch.setattr(kv_events, "EventPublisher", publisher)
    cfg = kv_events.KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0")
    publishers = await kv_events.rank_publishers(cfg, 2)
    try:
        assert taken == [1]
        for endpoints in (
            [p.endpoint for p in publishers],
            [p.replay_endpoint for p in publishers],
        ):
            first, second = (int(str(e).rpartition(":")[2]) for e in endpoints)
            assert second == first + 1
    finally:
        for p in publishers:
            await p.close()


async def test_an_endpoint_naming_a_host_connects_each_rank_to_its_port_with_the_topic(
    http: aiohttp.ClientSession,
) -> None:
    """llm-d's topology, as vLLM does it: the PUB socket connects (the subscriber binds), rank
    r to the port plus r, every batch with the topic and its rank."""
    port = two_free_ports()
    ctx: zmq.Context[Any] = zmq.Context()
    subs = []
    for rank in (0, 1):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.bind(f"tcp://127.0.0.1:{port + rank}")
        subs.append(sock)
    flag = events_flag(topic="kv@10.0.0.7@sim-model", endpoint=f"tcp://127.0.0.1:{port}")
    try:
        async with running_engine(*FAST, "-dp", "2", *flag, env=LOOPBACK_ENV) as eng:
            assert [r["kv_events_endpoint"] for r in eng.ranks] == [
                f"tcp://127.0.0.1:{port}",
                f"tcp://127.0.0.1:{port + 1}",
            ]
            for rank in (0, 1):
                got = None
                for first in range(1, 60):  # the first batches are lost while ZMQ connects
                    await on_rank(http, eng, tokens(100 * rank + first, 40), rank)
                    if subs[rank].poll(200):
                        got = subs[rank].recv_multipart()
                        break
                assert got is not None, f"rank {rank} published nothing"
                topic, _, payload = got
                assert topic == b"kv@10.0.0.7@sim-model"
                assert msgpack.unpackb(payload)[2] == rank
    finally:
        for sock in subs:
            sock.close(linger=0)
        ctx.term()
