"""The end-to-end checks shared by the push and pull modules."""

from __future__ import annotations

import asyncio
import itertools

from extproc.testing import scrape
from tests.real_vllm.clients import PROMPTS, ask, log_problems
from tests.support.real_vllm import EXPIRED, LEASE_S, Setup, by_source, counter, engine_metrics

KINDS = ("completions", "chat")


async def aggregated_answers(setup: Setup) -> dict[tuple[str, str], str]:
    """Greedy output of each prompt from one engine alone (P, asked without kv_transfer_params)."""
    answers = {}
    for kind, prompt in itertools.product(KINDS, PROMPTS):
        answer = await ask(setup.session, setup.prefill.url, kind, prompt, stream=False)
        assert answer.status == 200, answer.raw
        answers[kind, prompt] = answer.text
    return answers


async def check_disaggregated_equals_aggregated(setup: Setup, strategy: str) -> None:
    """Every prompt, completions and chat, streamed and not, through the sidecar: same text as
    aggregated; D's prompt tokens all arrived by KV transfer; the sidecar used `strategy`."""
    expected = await aggregated_answers(setup)
    before = by_source(await engine_metrics(setup.session, setup.decode))
    prompt_tokens = 0
    for kind, prompt, stream in itertools.product(KINDS, PROMPTS, (False, True)):
        answer = await ask(setup.session, setup.sidecar.url, kind, prompt, stream)
        assert answer.status == 200, (kind, prompt, stream, answer.raw[:500])
        assert answer.text == expected[kind, prompt], (kind, prompt, stream)
        assert answer.prompt_tokens > 0
        prompt_tokens += answer.prompt_tokens
    after = by_source(await engine_metrics(setup.session, setup.decode))
    moved = {s: after.get(s, 0.0) - before.get(s, 0.0) for s in after}
    assert moved.get("local_compute", 0.0) == 0, moved
    assert moved.get("local_cache_hit", 0.0) == 0, moved
    assert moved.get("external_kv_transfer", 0.0) == prompt_tokens, moved
    # An answer that started is counted from Envoy's access-log entry, flushed a moment later.
    wanted, deadline = len(KINDS) * len(PROMPTS) * 2, asyncio.get_running_loop().time() + 10
    while True:
        sidecar = await scrape(setup.session, setup.sidecar.metrics + "/metrics")
        used = sum(
            v
            for k, v in sidecar.items()
            if k.startswith("pd_extproc_requests_total{")
            and f'strategy="{strategy}"' in k
            and 'outcome="ok"' in k
        )
        if used >= wanted or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)  # polling the counter until the last entries are in
    assert used == wanted, sidecar


async def check_no_expired_leases(setup: Setup) -> None:
    """P kept no blocks that D never took: wait out the (shortened) lease, then count expiries."""
    await asyncio.sleep(LEASE_S + 3)
    metrics = await engine_metrics(setup.session, setup.prefill)
    assert counter(metrics, EXPIRED) == setup.expired_before
    assert counter(metrics, "vllm:nixl_num_failed_transfers_total") == 0
    assert "Releasing expired KV blocks" not in setup.new_log(setup.prefill)


def check_engine_logs_clean(setup: Setup) -> None:
    """The sidecar never sent either engine a body it rejected or failed on."""
    for engine in (setup.prefill, setup.decode):
        problems = log_problems(setup.new_log(engine))
        assert not problems, f"{engine.spec.role}:\n" + "\n".join(problems[:20])
