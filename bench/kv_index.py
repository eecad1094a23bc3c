"""What the KV-cache index costs: memory for a million blocks, and per-request tokenization and
lookup on the event loop. Prints two tables; run it alone (it times things):

    python -m bench.kv_index [--blocks 1000000] [--tokenizer ~/.cache/pd-extproc/tiny-llama]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from pathlib import Path

from extproc.kvcache.events import BlocksStored
from extproc.kvcache.index import KvIndex, chain_keys

_BLOCK = 16


def _conversation_events(rng: random.Random, blocks: int, chain: int) -> list[BlocksStored]:
    """Chains of `chain` blocks (a prompt each), as vLLM stores them: one event per prompt."""
    events = []
    for _ in range(blocks // chain):
        tokens = tuple(rng.randrange(32_000) for _ in range(chain * _BLOCK))
        hashes = tuple(rng.getrandbits(64) for _ in range(chain))  # as engine_hash() gives
        events.append(BlocksStored(hashes, None, tokens, _BLOCK, True))
    return events


def measure_memory(blocks: int, engines: int) -> None:
    rng = random.Random(7)
    per_engine = blocks // engines
    print(f"| blocks | engines | traced MiB | bytes/block | estimate MiB |")
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
    print(f"| {index.blocks:,} | {engines} | {used / 2**20:.1f} | {used / index.blocks:.0f} | "
          f"{index.bytes_estimate() / 2**20:.1f} |")


def _timed(fn: object, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def measure_request_cost(tokenizer_dir: Path | None, engines: int) -> None:
    from extproc.kvcache.tokens import RequestTokenizer

    tokenizer = RequestTokenizer.from_path(tokenizer_dir) if tokenizer_dir else None
    rng = random.Random(11)
    words = [f"w{rng.randrange(5000)}" for _ in range(4000)]
    index = KvIndex(max_blocks=1_000_000)
    print("\n| step (1024-token request) | median ms |")
    print("|---|---:|")
    if tokenizer is not None:
        text = " ".join(words)
        ids = tokenizer.completion(text)
        text = tokenizer.decode(ids[1:1024])
        ids = tokenizer.completion(text)[:1024]
        messages = [{"role": "system", "content": text[: len(text) // 2]},
                    {"role": "user", "content": text[len(text) // 2 :]}]
        print(f"| completion tokenize ({len(ids)} ids) | {_timed(lambda: tokenizer.completion(text), 200):.3f} |")
        print(f"| chat render + tokenize | {_timed(lambda: tokenizer.chat(messages), 200):.3f} |")
    else:
        ids = [rng.randrange(32_000) for _ in range(1024)]
    for i in range(engines):  # every engine holds half the prompt
        keys_held = len(chain_keys(ids, _BLOCK)) // 2
        hashes = tuple(range(1 + i * 1000, 1 + i * 1000 + keys_held))
        index.apply(f"engine-{i}", [BlocksStored(hashes, None, tuple(ids[: keys_held * _BLOCK]),
                                                 _BLOCK, True)])
    print(f"| longest prefix, {engines} engines | {_timed(lambda: index.longest_prefix(ids), 500):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--tokenizer", type=Path,
                        default=Path.home() / ".cache/pd-extproc/tiny-llama")
    args = parser.parse_args()
    measure_memory(args.blocks, args.engines)
    tok = args.tokenizer if (args.tokenizer / "tokenizer.json").is_file() else None
    measure_request_cost(tok, args.engines)


if __name__ == "__main__":
    main()
