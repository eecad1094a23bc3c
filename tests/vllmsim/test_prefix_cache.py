"""The prefix cache as vLLM's: cached prompt tokens skip prefill, usage and metrics report
them, least recently used blocks go first, and a D engine neither pulls nor is pushed the
blocks it already holds (and still answers as an aggregated engine does)."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest

from tests.vllmsim.vsim_helpers import get_json, metric, post
from vllmsim.kv_cache import BlockPool
from vllmsim.kv_events import AllBlocksCleared
from vllmsim.launcher import FAST, PULL_D, PULL_P, PUSH_D, PUSH_P, EngineHandle, running_engine
from vllmsim.prefix_cache import block_hashes

# Prefill costs 0.5 ms a token here, so a 1024-token prompt takes ~0.5 s to compute.
SLOW_PREFILL = (
    "--step-base-ms",
    "1",
    "--prefill-per-token-ms",
    "0.5",
    "--decode-per-seq-ms",
    "0",
    "--api-overhead-ms",
    "0",
    "--max-num-batched-tokens",
    "2048",
)


def tokens(first: int, n: int) -> list[int]:
    return [first, *range(1000, 1000 + n - 1)]


async def complete(
    http: aiohttp.ClientSession,
    eng: EngineHandle,
    prompt: list[int],
    rid: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    status, body = await post(
        http,
        eng,
        "/v1/completions",
        {"model": "sim-model", "prompt": prompt, "max_tokens": 4, **extra},
        rid=rid,
    )
    assert status == 200, body
    result: dict[str, Any] = body
    return result


async def timed(http: aiohttp.ClientSession, eng: EngineHandle, prompt: list[int]) -> float:
    started = time.monotonic()
    await complete(http, eng, prompt, max_tokens=1)
    return time.monotonic() - started


async def test_cached_tokens_skip_prefill_and_are_counted(http: aiohttp.ClientSession) -> None:
    async with running_engine(*SLOW_PREFILL, "--enable-prompt-tokens-details") as eng:
        prompt = tokens(1, 1024)
        cold = await timed(http, eng, prompt)
        warm = await timed(http, eng, prompt)
        assert cold > 0.45 and warm < 0.2  # 1008 of 1024 tokens come from the cache
        body = await complete(http, eng, prompt)
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1008}
        queries = await metric(http, eng, "vllm:prefix_cache_queries_total")
        hits = await metric(http, eng, "vllm:prefix_cache_hits_total")
        assert (queries, hits) == (3 * 1024, 2 * 1008)  # the last block is always computed
        by_source = {
            s: await metric(http, eng, "vllm:prompt_tokens_by_source_total", source=s)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }
        assert by_source == {
            "local_compute": 1024 + 2 * 16,
            "local_cache_hit": 2 * 1008,
            "external_kv_transfer": 0,
        }
        assert await metric(http, eng, "vllm:prompt_tokens_total") == 3 * 1024
        assert await metric(http, eng, "vllm:prompt_tokens_cached_total") == 2 * 1008


async def test_cached_tokens_in_the_stream_usage_and_only_when_asked(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        running_engine(*FAST, "--enable-prompt-tokens-details") as details,
        running_engine(*FAST) as plain,
    ):
        prompt = tokens(3, 100)
        for eng in (details, plain):
            first = await complete(http, eng, prompt)
            second = await complete(http, eng, prompt)
            assert first["usage"]["prompt_tokens_details"] is None  # nothing cached yet
            want = {"cached_tokens": 96} if eng is details else None
            assert second["usage"]["prompt_tokens_details"] == want
        body = {
            "prompt": prompt,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.post(details.url + "/v1/completions", json=body) as resp:
            raw = await resp.read()
        usage_line = [line for line in raw.split(b"\n\n") if b'"usage"' in line][-1]
        assert b'"prompt_tokens_details":{"cached_tokens":96}' in usage_line


async def test_no_enable_prefix_caching_never_hits(http: aiohttp.ClientSession) -> None:
    async with running_engine(
        *FAST, "--no-enable-prefix-caching", "--enable-prompt-tokens-details"
    ) as eng:
        prompt = tokens(4, 100)
        await complete(http, eng, prompt)
        body = await complete(http, eng, prompt)
        assert body["usage"]["prompt_tokens_details"] is None
        assert (await get_json(http, eng, "/sim/state"))["blocks_cached"] == 0
        assert await metric(http, eng, "vllm:prefix_cache_queries_total") == 0


async def test_least_recently_used_prompt_is_evicted_first(http: aiohttp.ClientSession) -> None:
    # 12 blocks; each prompt (64 tokens + 16 to generate) needs 5, of which 4 stay cached.
    async with running_engine(
        *FAST, "--num-gpu-blocks", "12", "--enable-prompt-tokens-details"
    ) as eng:
        a, b, c = tokens(1, 64), tokens(2, 64), tokens(3, 64)
        for prompt in (a, b):
            await complete(http, eng, prompt, max_tokens=16)
        await complete(http, eng, a, max_tokens=16)  # A is used again: B is now the oldest
        await complete(http, eng, c, max_tokens=16)  # needs blocks: B's go before A's
        hit_a = (await complete(http, eng, a, max_tokens=16))["usage"]["prompt_tokens_details"]
        hit_b = (await complete(http, eng, b, max_tokens=16))["usage"]["prompt_tokens_details"]
        assert hit_a == {"cached_tokens": 48}  # 64 - 1 tokens at most: 3 blocks
        assert hit_b is None or hit_b["cached_tokens"] < 48


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_d_does_not_transfer_blocks_it_holds(http: aiohttp.ClientSession, mode: str) -> None:
    p_cfg, d_cfg = (PULL_P, PULL_D) if mode == "pull" else (PUSH_P, PUSH_D)
    async with (
        running_engine(*FAST, "--kv-transfer-config", p_cfg) as p,
        running_engine(*FAST, "--kv-transfer-config", d_cfg, "--enable-prompt-tokens-details") as d,
        running_engine(*FAST) as plain,
    ):
        prompt = tokens(5, 200)  # 13 blocks, 12 of them full
        expected = (await complete(http, plain, prompt))["choices"][0]["text"]
        block_bytes = 2 * 1024 * 1024
        # Turn 1 moves all 13 prompt blocks; turn 2 only the last: D holds the 12 full ones.
        for turn, (moved_blocks, cached) in enumerate([(13, 0), (1, 192)]):
            before = await metric(http, p, "vllm:nixl_bytes_transferred_total")
            rid = f"{mode}-{turn}"  # P and D pair a push by request id
            status, pr = await post(
                http,
                p,
                "/v1/completions",
                {
                    "prompt": prompt,
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
                rid=rid,
            )
            assert status == 200
            params = pr["kv_transfer_params"]
            body = await complete(http, d, prompt, rid, kv_transfer_params=params)
            assert body["choices"][0]["text"] == expected, turn  # the KV is right either way
            moved = await metric(http, p, "vllm:nixl_bytes_transferred_total") - before
            assert moved == moved_blocks * block_bytes, turn
            # D's cached tokens, as vLLM counts them: its prefix-cache hit plus the transfer's
            assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 200}
            local = await metric(
                http, d, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
            )
            assert local == cached, turn
            # vLLM counts every prompt token, and the transferred ones as cached
            assert await metric(http, d, "vllm:prompt_tokens_total") == 200 * (turn + 1)
            assert await metric(http, d, "vllm:prompt_tokens_cached_total") == 200 * (turn + 1)


async def test_the_next_turn_finds_the_blocks_the_answer_filled(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        running_engine(*FAST, "--enable-prompt-tokens-details") as eng,
        running_engine(*FAST, "--no-enable-prefix-caching") as fresh,
    ):
        first = tokens(7, 40)
        answer = (await complete(http, eng, first, max_tokens=40))["choices"][0]["text"]
        async with http.post(
            eng.url + "/tokenize", json={"prompt": answer, "add_special_tokens": False}
        ) as resp:
            answer_ids = (await resp.json())["tokens"]
        assert len(answer_ids) >= 40
        # 40 prompt tokens + the 39 generated ones whose KV was computed: 4 full blocks
        second = [*first, *answer_ids, *tokens(8, 30)]
        body = await complete(http, eng, second, max_tokens=8)
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
        # the cached blocks hold what a prefill of those tokens gives: the same answer
        reference = await complete(http, fresh, second, max_tokens=8)
        assert body["choices"][0]["text"] == reference["choices"][0]["text"]


async def test_reset_prefix_cache_forgets_every_cached_prompt_in_dev_mode(
    http: aiohttp.ClientSession,
) -> None:
    """vLLM's POST /reset_prefix_cache, which exists only with VLLM_SERVER_DEV_MODE=1: the
    next request computes its whole prompt again (the benchmarks reset between runs)."""
    flags = (*FAST, "--enable-prompt-tokens-details")
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    async with running_engine(*flags, env=dev) as eng, running_engine(*flags) as plain:
        prompt = tokens(3, 64)
        await complete(http, eng, prompt)
        cached = (await complete(http, eng, prompt))["usage"]["prompt_tokens_details"]
        assert cached == {"cached_tokens": 48}
        async with http.post(eng.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        assert (await complete(http, eng, prompt))["usage"]["prompt_tokens_details"] is None
        async with http.post(plain.url + "/reset_prefix_cache") as resp:
            assert resp.status == 404


def test_a_pool_with_a_block_in_use_keeps_its_prefixes() -> None:
    pool = BlockPool(8, caching=True, block_size=16)
    ids = tokens(5, 32)
    hashes = block_hashes(ids, 16)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache(blocks, hashes, 0, ids)
    assert not pool.reset_prefix_cache()  # in use: nothing forgotten
    assert pool.lookup(hashes, 2) == blocks
    pool.free(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.lookup(hashes, 2) == [] and pool.cached_blocks == 0
    assert [type(e) for e in pool.take_events()] == [AllBlocksCleared]


LORA = ("--enable-lora", "--lora-modules", "sim-lora=/adapters/sim-lora")


async def test_a_salted_or_adapter_prompt_misses_what_the_plain_one_cached(
    http: aiohttp.ClientSession,
) -> None:
    """As vLLM: a block's hash covers the request's cache_salt and LoRA adapter, so the same
    tokens under another salt or adapter are computed again, and hit only their own."""
    async with running_engine(*FAST, *LORA, "--enable-prompt-tokens-details") as eng:
        prompt = tokens(5, 100)

        async def cached(**extra: Any) -> Any:
            return (await complete(http, eng, prompt, **extra))["usage"]["prompt_tokens_details"]

        assert await cached() is None
        assert await cached() == {"cached_tokens": 96}
        assert await cached(cache_salt="tenant-a") is None
        assert await cached(cache_salt="tenant-b") is None
        assert await cached(cache_salt="tenant-a") == {"cached_tokens": 96}
        assert await cached(model="sim-lora") is None
        assert await cached(model="sim-lora", cache_salt="tenant-a") is None
        assert await cached(model="sim-lora") == {"cached_tokens": 96}


@pytest.mark.parametrize("salt", ["", 7, ["s"]])
async def test_a_cache_salt_that_is_no_nonempty_string_is_refused(
    http: aiohttp.ClientSession, salt: object
) -> None:
    async with running_engine(*FAST) as eng:
        status, body = await post(
            http,
            eng,
            "/v1/completions",
            {"model": "sim-model", "prompt": tokens(6, 20), "max_tokens": 1, "cache_salt": salt},
        )
    assert status == 400 and "cache_salt" in body["error"]["message"]


async def test_adapters_are_listed_under_their_base_model(http: aiohttp.ClientSession) -> None:
    async with running_engine(*FAST, *LORA) as eng:
        listed = await get_json(http, eng, "/v1/models")
    assert [(m["id"], m["parent"]) for m in listed["data"]] == [
        ("sim-model", None),
        ("sim-lora", "sim-model"),
    ]
