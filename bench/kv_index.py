"""What the KV-cache index costs: memory for a million blocks, and per-request tokenization and
lookup on the event loop. Prints two tables; run it alone (it times things):

    python -m bench.kv_index [--blocks 1000000] [--tokenizer ~/.cache/pd-extproc/tiny-llama]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from extproc.kvcache.events import BlocksStored
from extproc.kvcache.index import KvIndex, chain_keys
from extproc.kvcache.tokens import OffLoopTokenizer, RequestTokenizer

_BLOCK = 16


def _conversation_events(rng: random.Random, blocks: int, chain: int) -> list[BlocksStored]:
    """Chains of `chain` blocks (a prompt each), as vLLM stores them: one event per prompt."""
    events = []
    for _ in range(blocks // chain):
        tokens = tuple(rng.randrange(32_000) for _ in range(chain * _BLOCK))
        hashes = tuple(rng.getrandbits(60) for _ in range(chain))  # as engine_hash() gives
        events.append(BlocksStored(hashes, None, tokens, _BLOCK, True))
    return events


def measure_memory(blocks: int, engines: int) -> None:
    rng = random.Random(7)
    per_engine = blocks // engines
    print("| blocks | engines | traced MiB | bytes/block | estimate MiB |")
    print("|---:|---:|---:|---:|---:|")
    gc.collect()
    tracemalloc.start()  # before the events: the engine hashes they carry stay in the index
    base = tracemalloc.get_traced_memory()[0]
    index = KvIndex(max_blocks=blocks)
    for i in range(engines):
        index.apply(f"engine-{i}", _conversation_events(rng, per_engine, 64))
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    print(
        f"| {index.blocks:,} | {engines} | {used / 2**20:.1f} | {used / index.blocks:.0f} | "
        f"{index.bytes_estimate() / 2**20:.1f} |"
    )


def _timed(fn: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _loop_cpu_ms(off: OffLoopTokenizer, text: str, repeat: int) -> tuple[float, float]:
    """CPU of the event loop's thread, and wall time, per request tokenized off the loop."""

    async def run() -> tuple[float, float]:
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(repeat):
            await off.completion(text)
        return (
            (time.thread_time() - cpu) / repeat * 1e3,
            (time.perf_counter() - wall) / repeat * 1e3,
        )

    return asyncio.run(run())


def measure_request_cost(tokenizer_dir: Path | None, engines: int) -> None:
    rng = random.Random(11)
    index = KvIndex(max_blocks=1_000_000)
    print("\n| step (1024-token request) | median ms |")
    print("|---|---:|")
    if tokenizer_dir is not None:
        tok = RequestTokenizer.from_path(tokenizer_dir)
        text = tok.decode(
            tok.completion(" ".join(f"w{rng.randrange(5000)}" for _ in range(4000)))[1:1024]
        )
        ids = tok.completion(text)[:1024]
        half = len(text) // 2
        messages = [
            {"role": "system", "content": text[:half]},
            {"role": "user", "content": text[half:]},
        ]
        rows = {
            f"completion: tokenize on the loop ({len(ids)} ids)": lambda: tok.completion(text),
            "chat: render the template": lambda: tok.render_chat(messages),
            "chat: render + tokenize on the loop": lambda: tok.chat(messages),
        }
        for name, fn in rows.items():
            print(f"| {name} | {_timed(fn, 300):.3f} |")
        off = OffLoopTokenizer(tok)
        cpu, wall = _loop_cpu_ms(off, text, 300)
        off.close()
        print(f"| completion off the loop: loop-thread CPU | {cpu:.3f} |")
        print(f"| completion off the loop: wall | {wall:.3f} |")
    else:
        ids = [rng.randrange(32_000) for _ in range(1024)]
    held = len(chain_keys(ids, _BLOCK))
    for i in range(engines):  # engine i holds the first (i + 1) / engines of the prompt
        n = held * (i + 1) // engines
        hashes = tuple(range(1 + i * 1000, 1 + i * 1000 + n))
        index.apply(
            f"engine-{i}", [BlocksStored(hashes, None, tuple(ids[: n * _BLOCK]), _BLOCK, True)]
        )
    name = f"longest prefix, {engines} engines (one holds it all)"
    print(f"| {name} | {_timed(lambda: index.longest_prefix(ids), 500):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument(
        "--tokenizer", type=Path, default=Path.home() / ".cache/pd-extproc/tiny-llama"
    )
    args = parser.parse_args()
    measure_memory(args.blocks, args.engines)
    tok = args.tokenizer if (args.tokenizer / "tokenizer.json").is_file() else None
    measure_request_cost(tok, args.engines)


if __name__ == "__main__":
    main()
