"""The API server tokenizes one prompt at a time (vLLM's renderer: one tokenizer thread)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.vllmsim.vsim_helpers import PROMPT, post, record
from vllmsim.cost_model import Fifo
from vllmsim.launcher import FAST, running_engine

PER_TOKEN_MS = 1.0


def test_work_taken_on_while_busy_ends_after_what_came_before() -> None:
    fifo = Fifo()
    assert abs(fifo.take(0.010, now=0.0) - 0.010) < 1e-12
    assert abs(fifo.take(0.010, now=0.004) - 0.016) < 1e-12  # waits 6 ms, then its 10
    assert abs(fifo.take(0.010, now=1.0) - 0.010) < 1e-12  # idle again


async def test_two_prompts_arriving_together_are_tokenized_one_after_the_other(
    http: aiohttp.ClientSession,
) -> None:
    slow = ("--tokenize-per-token-ms", str(PER_TOKEN_MS))
    async with running_engine(*FAST, *slow) as eng:
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 1}
        replies = await asyncio.gather(
            *(post(http, eng, "/v1/completions", body, rid=rid) for rid in ("a", "b"))
        )
        assert [status for status, _ in replies] == [200, 200]
        tokens = replies[0][1]["usage"]["prompt_tokens"]
        recs = [await record(http, eng, rid) for rid in ("a", "b")]
    one = tokens * PER_TOKEN_MS / 1000.0
    waits = sorted(r["first_token_at"] - r["received_at"] for r in recs)
    assert one <= waits[0] < 1.8 * one  # the first: its own tokenization
    assert waits[1] >= 2 * one  # the second: the first's, then its own
