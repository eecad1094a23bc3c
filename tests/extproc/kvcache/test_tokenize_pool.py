"""Request token ids from worker processes: the same ids as inline, the loop free meanwhile,
and every way out bounded (time, queue, a dead worker, close)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from array import array
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from subprocess import PIPE
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from extproc.kvcache import tokenize_workers
from extproc.kvcache.tokenize_pool import OffLoopTokenizer, members_object
from extproc.kvcache.tokenize_workers import WorkerProcesses
from extproc.kvcache.tokens import RequestTokenizer, token_ids

WORDS = [f"w{i}" for i in range(100)]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
STALL_S = 0.25  # the loop's longest wait allowed (the bound), well above noise


def processes(off: OffLoopTokenizer) -> WorkerProcesses:
    """The worker processes behind `off` (the test looks inside)."""
    assert isinstance(off._pool, WorkerProcesses)
    return off._pool


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    vocab = {w: i for i, w in enumerate(["<s>", "<unk>", "<user>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return tmp_path


@pytest.fixture
async def pool(model_dir: Path) -> AsyncIterator[Callable[..., OffLoopTokenizer]]:
    made: list[OffLoopTokenizer] = []

    def make(**options: Any) -> OffLoopTokenizer:
        made.append(OffLoopTokenizer(str(model_dir), **options))
        return made[-1]

    yield make
    for each in made:
        each.close()


def text(words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(words))


def completion(prompt: str) -> tuple[dict[str, Any], bytes]:
    doc = {"model": "m", "prompt": prompt, "max_tokens": 1}
    return doc, members_object([("prompt", orjson.dumps({"prompt": prompt})[1:-1])], False)


def chat(messages: list[dict[str, str]]) -> tuple[dict[str, Any], bytes]:
    doc = {"model": "m", "messages": messages}
    return doc, members_object([("messages", orjson.dumps({"messages": messages})[1:-1])], True)


async def test_a_worker_gives_the_ids_inline_would(
    pool: Callable[..., OffLoopTokenizer], model_dir: Path
) -> None:
    tokenizer = RequestTokenizer.from_path(model_dir)
    off = pool(inline_below_bytes=16, workers=1)
    prompt_doc, prompt_raw = completion(text(500))
    chat_doc, chat_raw = chat([{"role": "user", "content": text(300)}] * 3)
    assert await off.ids(False, prompt_doc, prompt_raw) == token_ids(
        tokenizer, False, prompt_doc, None
    )
    assert await off.ids(True, chat_doc, chat_raw) == token_ids(tokenizer, True, chat_doc, None)
    assert (await off.ids(False, prompt_doc, prompt_raw))[:2] == [0, 3]  # BOS, then w0
    # a completion's text handed over as it is (not joined into JSON first): the same ids
    assert await off.ids(False, prompt_doc, prompt_doc["prompt"]) == token_ids(
        tokenizer, False, prompt_doc, None
    )


async def test_a_long_prompt_leaves_the_loop_free(pool: Callable[..., OffLoopTokenizer]) -> None:
    off = pool(workers=1, timeout_s=60)
    off.warm()
    doc, raw = completion(text(2_000_000))  # ~8 MB: seconds of encoding on this loop
    longest = 0.0
    beating, done = asyncio.Event(), asyncio.Event()

    async def beat() -> None:
        nonlocal longest
        beating.set()
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            longest = max(longest, time.perf_counter() - before - 0.01)

    beater = asyncio.create_task(beat())
    await beating.wait()
    try:
        ids = await off.ids(False, doc, raw)
    finally:
        done.set()
        await beater
    assert ids is not None and len(ids) == 2_000_001
    assert longest < STALL_S


async def test_a_job_past_its_time_gets_no_ids_and_its_worker_is_ended(
    pool: Callable[..., OffLoopTokenizer],
) -> None:
    off = pool(workers=1, timeout_s=0.05)
    off.warm()
    [old] = await worker_pids(off)
    assert await off.ids(False, *completion(text(1_000_000))) is None
    await ended(old)  # not left to encode on
    assert await off.ids(False, *completion("w1")) == [0, 4]  # inline: no worker needed
    [new] = await worker_pids(off)
    assert new != old


async def test_past_its_queue_a_request_gets_no_ids_at_once(
    pool: Callable[..., OffLoopTokenizer],
) -> None:
    off = pool(workers=1, max_pending=1, timeout_s=30)
    first = asyncio.create_task(off.ids(False, *completion(text(1_000_000))))
    await worker_pids(off)
    assert off._pending == 1  # the test looks inside: the first request is in
    assert await off.ids(False, *completion(text(2000))) is None
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_long_jobs_leave_a_worker_to_the_short_ones(
    pool: Callable[..., OffLoopTokenizer],
) -> None:
    """Two workers, two long prompts in: a short one is still tokenized at once, not after
    them (it would wait out its time budget and route without the cache)."""
    off = pool(workers=2, timeout_s=60)
    off.warm()
    long_jobs = [
        asyncio.create_task(off.ids(False, *completion(text(2_000_000)))) for _ in range(2)
    ]
    await asyncio.sleep(0)  # both run to their first wait
    assert off._pending == 2  # the test looks inside: both long requests are in
    doc, raw = completion(text(2000))
    try:
        assert await asyncio.wait_for(off.ids(False, doc, raw), 30) is not None
        assert not any(job.done() for job in long_jobs)  # it did not wait for either
    finally:
        for job in long_jobs:
            job.cancel()
        await asyncio.gather(*long_jobs, return_exceptions=True)


async def test_long_jobs_take_all_workers_but_one_from_the_threshold_on(
    pool: Callable[..., OffLoopTokenizer],
) -> None:
    """Three workers: two long prompts run at once (the lane is all workers but one). Two
    workers: a prompt of exactly `long_from_bytes` is long, so a second waits for the lane."""
    doc, raw = completion(text(1_000_000))
    for workers, long_from, taken in ((3, 256 << 10, 2), (2, len(raw), 1)):
        off = pool(workers=workers, timeout_s=60, long_from_bytes=long_from)
        off.warm()
        jobs = [asyncio.create_task(off.ids(False, doc, raw)) for _ in range(2)]
        await asyncio.sleep(0)  # both run to their first wait
        try:
            assert off._pending == 2  # the test looks inside: both requests are in ...
            assert (
                processes(off)._idle.qsize() == workers - taken
            )  # ... and this many have a worker
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)


async def test_a_prompt_longer_than_the_context_gets_no_ids(
    pool: Callable[..., OffLoopTokenizer],
) -> None:
    off = pool(inline_below_bytes=16)
    doc, raw = completion(text(1000))  # 1,001 tokens with the BOS
    assert await off.ids(False, doc, raw, context=1000) is None
    assert await off.ids(False, doc, raw, context=1001) is not None
    small = completion("w1 w2")
    assert await off.ids(False, *small, context=2) is None  # inline, the same bound


def test_a_text_longer_than_context_times_the_longest_token_is_not_encoded(
    model_dir: Path,
) -> None:
    class Counted(RequestTokenizer):
        encoded = 0

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            Counted.encoded += 1
            return super().encode(text, add_special_tokens)

    tokenizer = Counted.from_path(model_dir)
    longest = tokenizer.longest_token  # "<unk>", "<user>": 6 characters
    doc = {"prompt": "w1 " * 100}  # 300 characters, 101 tokens
    assert token_ids(tokenizer, False, doc, 300 // longest - 1) is None
    assert Counted.encoded == 0
    assert token_ids(tokenizer, False, doc, 300 // longest) is None  # encoded: too many tokens
    assert Counted.encoded == 1


async def test_a_dead_worker_costs_its_request_then_new_workers_serve(
    pool: Callable[..., OffLoopTokenizer], caplog: pytest.LogCaptureFixture
) -> None:
    off = pool(workers=1, timeout_s=30)
    asking = asyncio.create_task(off.ids(False, *completion(text(1_000_000))))
    [pid] = await worker_pids(off)
    os.kill(pid, signal.SIGKILL)
    assert await asking is None
    assert "a tokenizer worker died" in caplog.text
    assert await off.ids(False, *completion(text(3000))) == [0, *[3 + i % 100 for i in range(3000)]]
    assert pid not in await worker_pids(off)


async def test_workers_that_cannot_load_the_tokenizer_say_so_once_and_are_not_respawned(
    pool: Callable[..., OffLoopTokenizer], model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The folder changed after the sidecar read it (a volume swapped): each request past the
    inline size must not fork a worker that fails again, each with a traceback."""
    off = pool(workers=1, timeout_s=30)
    (model_dir / "tokenizer.json").unlink()
    off.warm()
    started = list(processes(off)._all)  # the test looks inside: which executors run
    for _ in range(3):
        assert await off.ids(False, *completion(text(3000))) is None
    assert processes(off)._all == started
    assert caplog.text.count("tokenizer workers cannot load") == 1
    assert "a tokenizer worker died" not in caplog.text
    assert await off.ids(False, *completion(text(5))) == [0, 3, 4, 5, 6, 7]  # inline still


async def test_close_ends_a_worker_in_the_middle_of_a_job(
    pool: Callable[..., OffLoopTokenizer],
) -> None:
    off = pool(workers=1, timeout_s=30)
    asking = asyncio.create_task(off.ids(False, *completion(text(1_000_000))))
    [pid] = await worker_pids(off)
    off.close()
    await ended(pid)
    assert await asking is None
    assert processes(off)._all == []  # no worker started again


SIDECAR = """
import asyncio, sys
from extproc.kvcache.tokenize_pool import OffLoopTokenizer

async def main() -> None:
    off = OffLoopTokenizer(sys.argv[1])
    off.warm()
    while not (pids := [p for w in off._pool._all for p in (w._processes or {})]):
        await asyncio.sleep(0.02)
    print(*pids, flush=True)
    await asyncio.sleep(600)

if __name__ == "__main__":
    asyncio.run(main())
"""


async def test_the_workers_of_a_killed_sidecar_exit(model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "sidecar.py"
    script.write_text(SIDECAR)
    sidecar = await asyncio.create_subprocess_exec(
        sys.executable, str(script), str(model_dir), stdout=asyncio.subprocess.PIPE
    )
    assert sidecar.stdout is not None
    line = await asyncio.wait_for(sidecar.stdout.readline(), 60)
    workers = [int(pid) for pid in line.split()]
    assert workers and all(alive(pid) for pid in workers)
    sidecar.kill()  # no close: the workers must notice on their own
    await sidecar.wait()
    for pid in workers:
        await ended(pid)


async def ended(pid: int) -> None:
    for _ in range(200):
        if not alive(pid):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"worker {pid} still runs")


async def worker_pids(off: OffLoopTokenizer) -> list[int]:
    """The pool's worker processes once one has started (polled, bounded)."""
    for _ in range(200):
        # the test looks inside: which processes to kill or watch
        pids = [pid for worker in processes(off)._all for pid in (worker._processes or {})]
        if pids:
            return pids
        await asyncio.sleep(0.02)
    raise AssertionError("no worker started")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a child that exited stays as a zombie until reaped: read its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_members_object_copies_a_long_prompt_once() -> None:
    prompt = b'"prompt":"' + b"w" * (4 << 20) + b'"'
    parts = [("model", b'"model":"m"'), ("prompt", prompt), ("max_tokens", b'"max_tokens":1')]
    tracemalloc.start()
    try:
        raw = members_object(parts, False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert orjson.loads(raw) == {"prompt": "w" * (4 << 20)}
    assert peak < 1.1 * len(prompt)  # the object itself: no intermediate copy beside it


async def test_workers_are_forked_by_the_fork_server_not_by_the_sidecar(
    pool: Callable[..., OffLoopTokenizer],
) -> None:
    off = pool(workers=1)
    off.warm()
    [pid] = await worker_pids(off)
    status = await asyncio.to_thread(Path(f"/proc/{pid}/status").read_text)
    parent = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid"))
    assert parent != os.getpid()  # a fork of the sidecar would copy its threads' state


# -- the worker side, called in this process (mutation testing cannot see into a worker) ------


def test_the_worker_side_gives_the_ids_as_int32_bytes_or_none(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = RequestTokenizer.from_path(str(model_dir), None)
    monkeypatch.setattr(tokenize_workers, "_worker_tokenizer", tokenizer)
    asked = (False, completion(text(5))), (True, chat([{"role": "user", "content": "w1 w2"}]))
    for is_chat, (doc, raw) in asked:
        ids = token_ids(tokenizer, is_chat, doc, None)
        assert ids and tokenize_workers._work(is_chat, raw, None) == array("i", ids).tobytes()
    assert tokenize_workers._work(False, completion(text(5))[1], 2) is None  # over the context
    assert tokenize_workers._work(False, b'{"prompt": 5}', None) is None  # no ids: as inline
    monkeypatch.setattr(tokenize_workers, "_worker_tokenizer", None)  # could not load it
    assert tokenize_workers._work(False, completion(text(5))[1], None) is None


def test_a_worker_starts_niced_deaf_to_ctrl_c_and_watching_its_sidecar(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done: list[Any] = []
    template = tmp_path / "override.jinja"  # as vLLM's --chat-template: no role tags
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")

    class Thread:
        def __init__(self, target: Any, args: tuple[Any, ...], daemon: bool) -> None:
            done.append(("thread", target, args, daemon))

        def start(self) -> None:
            done.append("started")

    def nice(increment: int) -> None:
        done.append(("nice", increment))

    def handle(*how: Any) -> None:
        done.append(how)

    # the module's own names only: this process's niceness, signals and threads stay as they are
    monkeypatch.setattr(tokenize_workers, "os", SimpleNamespace(nice=nice))
    signals = SimpleNamespace(signal=handle, SIGINT=2, SIG_IGN=1)
    monkeypatch.setattr(tokenize_workers, "signal", signals)
    monkeypatch.setattr(tokenize_workers, "threading", SimpleNamespace(Thread=Thread))
    monkeypatch.setattr(tokenize_workers, "_worker_tokenizer", None)
    monkeypatch.setattr(tokenize_workers, "_worker_error", None)
    tokenize_workers._start_worker(str(model_dir), str(template), 4321)
    assert done == [
        ("nice", 10),
        (2, 1),  # SIGINT ignored
        ("thread", tokenize_workers._exit_with, (4321,), True),
        "started",
    ]
    loaded = tokenize_workers._worker_tokenizer
    assert loaded is not None and tokenize_workers._ready() is None
    doc = {"messages": [{"role": "user", "content": "w1 w2"}]}
    assert token_ids(loaded, True, doc, None) == [4, 5]  # the override's, not "<user> w1 w2"
    (model_dir / "tokenizer.json").unlink()  # its files changed since the sidecar read them
    tokenize_workers._start_worker(str(model_dir), None, 4321)
    assert (tokenize_workers._ready() or "").startswith("TokenizerFilesError: cannot load")


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polled"])
def test_a_worker_exits_once_its_sidecar_has(monkeypatch: pytest.MonkeyPatch, pidfd: bool) -> None:
    sidecar = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=PIPE)
    exits: list[int] = []

    def no_pidfd(pid: int) -> int:  # an old kernel
        raise OSError("pidfd_open")

    watched = SimpleNamespace(
        pidfd_open=os.pidfd_open if pidfd else no_pidfd, kill=os.kill, _exit=exits.append
    )
    monkeypatch.setattr(tokenize_workers, "os", watched)  # the module's name only
    monkeypatch.setattr(tokenize_workers, "_PARENT_CHECK_S", 0.01)
    watcher = threading.Thread(target=tokenize_workers._exit_with, args=(sidecar.pid,), daemon=True)
    watcher.start()
    watcher.join(0.2)
    assert watcher.is_alive() and not exits  # the sidecar lives: so does the worker
    assert sidecar.stdin is not None
    sidecar.stdin.close()
    sidecar.wait()
    watcher.join(10)
    assert exits == [0]


def test_a_process_is_alive_until_it_has_exited() -> None:
    code = "import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); print(flush=True); "
    code += "sys.stdin.read()"  # a signal would end it (even where a parent ignores SIGHUP)
    process = subprocess.Popen([sys.executable, "-c", code], stdin=PIPE, stdout=PIPE)
    assert process.stdin is not None and process.stdout is not None
    assert process.stdout.readline() == b"\n"  # ready
    assert tokenize_workers._alive(process.pid)
    process.stdin.close()
    assert process.wait() == 0  # the probe sent it no signal
    assert not tokenize_workers._alive(process.pid)  # reaped: no such process now


async def test_a_burst_of_concurrent_prompts_is_tokenized_whole(
    pool: Callable[..., OffLoopTokenizer],
) -> None:
    """64 prompts of 2,000 words at once (a closed loop at C = 64, each over the inline size):
    every one gets its ids. With a queue of 16, 48 were routed without the KV index, to a P
    that did not hold their prefix, which then held it too and evicted another."""
    off = pool(workers=1, timeout_s=30)
    answers = await asyncio.gather(
        *(off.ids(False, *completion(f"w{n % 100} {text(2000)}")) for n in range(64))
    )
    assert all(ids is not None and len(ids) == 2002 for ids in answers)


async def test_why_a_request_got_no_ids_is_told(pool: Callable[..., OffLoopTokenizer]) -> None:
    """The sidecar counts each request routed without its ids, by why (a metric)."""
    told: list[str] = []
    off = pool(workers=1, max_pending=1, timeout_s=0.05, on_unknown=told.append)
    off.warm()
    await worker_pids(off)
    first = asyncio.create_task(off.ids(False, *completion(text(1_000_000))))
    await asyncio.sleep(0)  # it runs to its first wait: the queue is full
    assert await off.ids(False, *completion(text(2000))) is None
    assert await first is None
    assert told == ["queue_full", "timeout"]
