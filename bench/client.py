"""Drive `vllm bench serve` (from the cached vllm venv) over a list of runs, read its results.

One client process serves a whole plan (see vllm_bench_loop.py); each run is the PR #187 test
plan's command: random 1024-token prompts, 64 output tokens, 2 × C prompts at concurrency C.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bench.procs import pinned, running_process

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.cached_envs import bench_client_cmd, bench_client_env  # noqa: E402

INPUT_LEN, OUTPUT_LEN = 1024, 64
DONE = re.compile(r"^BENCH-DONE (\S+) (.*)$", re.M)


@dataclass(frozen=True)
class Run:
    id: str
    topology: str
    config: str
    concurrency: int
    index: int  # which repetition
    url: str
    result: Path
    workload: Path | None = None  # a JSONL of bench/workload.py; None: random 1024 / 64
    # Overrides of the PR #187 plan's 2 × C prompts, warm-ups and seed, and extra client flags
    num_prompts: int | None = None
    num_warmups: int | None = None
    seed: int | None = None
    flags: tuple[str, ...] = ()


def warmups(concurrency: int) -> int:
    """A wave of warm-up requests (the router's first request per P is serial; connections
    open). Capped: at C = 64 a full wave would cost more than the run, and the proxies' upstream
    pools stay warm from the runs before."""
    return min(max(2, concurrency), 8)


def dataset_flags(workload: Path | None) -> list[str]:
    if workload is None:
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(INPUT_LEN),
            "--random-output-len",
            str(OUTPUT_LEN),
            "--random-range-ratio",
            "0",
        ]
    # each line's own output_tokens; the prompts are raw text, sent as they are
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(workload),
        "--custom-output-len",
        "-1",
        "--skip-chat-template",
    ]


def bench_flags(run: Run, model: str, tokenizer: Path) -> list[str]:
    return [
        "--base-url",
        run.url,
        "--endpoint",
        "/v1/completions",
        "--backend",
        "openai",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        *dataset_flags(run.workload),
        "--ignore-eos",
        *run.flags,
        "--num-prompts",
        str(run.num_prompts or 2 * run.concurrency),
        "--max-concurrency",
        str(run.concurrency),
        "--num-warmups",
        str(warmups(run.concurrency) if run.num_warmups is None else run.num_warmups),
        "--seed",
        str(1000 + run.index if run.seed is None else run.seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        # the harness waits for every target itself: no extra 64-token test request per run
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "0",
        "--save-result",
        "--save-detailed",
        "--result-filename",
        str(run.result),
    ]


def time_budget_s(runs: list[Run]) -> float:
    """A generous bound for the whole plan: start-up plus a slow pace per request."""
    return 120 + sum(30 + 1.0 * (r.num_prompts or 2 * r.concurrency) * 1.5 for r in runs)


# Called between two runs of a gated plan, with the run just done (None before the first) and
# the run about to start (None after the last): the client waits until it returns.
StepHook = Callable[[str | None, str | None], Awaitable[None]]


async def run_plan(
    runs: list[Run],
    model: str,
    tokenizer: Path,
    work: Path,
    cpus: set[int] | None = None,
    between: StepHook | None = None,
) -> dict[str, dict]:
    """Run every entry in one client process; return {run id: result JSON or {'error': ...}}.

    With `between`, each run starts only once the hook for it has returned (a gate file), so
    that the harness can read the engines' counters exactly at run boundaries.
    """
    plan = [{"id": r.id, "argv": bench_flags(r, model, tokenizer)} for r in runs]
    if between is not None:
        for entry in plan:
            entry["gate"] = str(work / f"{entry['id']}.go")
    plan_path, log_path = work / "plan.json", work / "client.log"
    plan_path.write_text(json.dumps(plan))
    python = bench_client_cmd()[0]
    argv = [python, str(Path(__file__).with_name("vllm_bench_loop.py")), str(plan_path)]
    with pinned(cpus):
        runner = running_process(argv, log_path, env=bench_client_env())
        process = await runner.__aenter__()
    try:
        await _follow(process, log_path, plan, time_budget_s(runs), between)
    finally:
        await runner.__aexit__(None, None, None)
    return {r.id: _load(r, log_path) for r in runs}


async def _follow(
    process: asyncio.subprocess.Process,
    log_path: Path,
    plan: list[dict],
    budget_s: float,
    between: StepHook | None,
) -> None:
    """Print progress as runs finish, open each run's gate after the hook; stop at the budget."""
    deadline, seen, total = time.monotonic() + budget_s, 0, len(plan)
    if between is not None and plan:
        await between(None, plan[0]["id"])
        await asyncio.to_thread(Path(plan[0]["gate"]).touch)
    while process.returncode is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"client plan exceeded {budget_s:.0f} s (log: {log_path})")
        text = await asyncio.to_thread(log_path.read_text, errors="replace")
        done = DONE.findall(text)
        for run_id, status in done[seen:]:
            print(f"  [{len(done)}/{total}] {run_id} {status}", flush=True)
            if between is not None:
                upcoming = plan[len(done)] if len(done) < total else None
                await between(run_id, upcoming["id"] if upcoming else None)
                if upcoming:
                    await asyncio.to_thread(Path(upcoming["gate"]).touch)
        seen = len(done)
        await asyncio.sleep(0.1 if between else 0.5)


def _load(run: Run, log_path: Path) -> dict:
    statuses = dict(DONE.findall(log_path.read_text(errors="replace")))
    if statuses.get(run.id) != "ok" or not run.result.exists():
        return {"error": statuses.get(run.id, "did not run")}
    return json.loads(run.result.read_text())
