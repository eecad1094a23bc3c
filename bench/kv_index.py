"""What the KV-cache index costs: memory for a million blocks, and per-request tokenization and
lookup on the event loop. Prints two tables; run it alone (it times things):

    python -m bench.kv_index [--blocks 1000000] [--tokenizer ~/.cache/pd-extproc/tiny-llama]
                             [--compare main] [--event-stalls]

Memory is measured in a fresh process per cell, twice: traced by tracemalloc, and as the
growth of the process's resident set (without tracemalloc). `--compare REF` measures the
index.py of a git ref beside this one, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack

from extproc.kvcache.events import BlocksStored, MalformedBatch, decode_batch
from extproc.kvcache.index import KvIndex, chain_keys
from extproc.kvcache.subscriber import EngineEvents
from extproc.kvcache.tokens import OffLoopTokenizer, RequestTokenizer
from extproc.metrics import Metrics

_BLOCK = 16
_CHAIN = 64  # blocks a prompt: 1024 tokens
_SCENARIOS = {"distinct": "no block shared", "shared": "every block on all engines"}


def _chain_tokens(chain: int) -> tuple[int, ...]:
    rng = random.Random(chain)
    return tuple(array("H", rng.randbytes(_CHAIN * _BLOCK * 2)))


def _events(engine: int, chains: range) -> Iterator[BlocksStored]:
    """One BlockStored a prompt of 64 blocks, as vLLM stores them, made one at a time (so that
    the events themselves do not swell the process). Engine hashes are the engine's own."""
    rng = random.Random(1000 + engine)
    for chain in chains:
        hashes = tuple(rng.getrandbits(60) for _ in range(_CHAIN))  # as engine_hash() gives
        yield BlocksStored(hashes, None, _chain_tokens(chain), _BLOCK, True)


def _index_class(source: str | None) -> Any:
    """KvIndex of this tree, or of an index.py given as a file (another ref's)."""
    if source is None:
        return KvIndex
    spec = importlib.util.spec_from_file_location("kv_index_compared", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.KvIndex


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def memory_cell(
    source: str | None, scenario: str, blocks: int, engines: int, traced: bool
) -> dict[str, Any]:
    """Build a full index in this process; the memory it took."""
    index_class = _index_class(source)
    gc.collect()
    if traced:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if traced else _rss()
    index = index_class(max_blocks=blocks)
    for engine, events in _engines_events(scenario, blocks, engines):
        index.apply(engine, events)
    gc.collect()
    used = (tracemalloc.get_traced_memory()[0] if traced else _rss()) - before
    if traced:
        tracemalloc.stop()
    return {"blocks": index.blocks, "bytes": used, "estimate": index.bytes_estimate()}


def _engines_events(
    scenario: str, blocks: int, engines: int
) -> Iterator[tuple[str, Iterator[BlocksStored]]]:
    chains = blocks // engines // _CHAIN
    for engine in range(engines):
        first = 0 if scenario == "shared" else engine * chains
        yield f"engine-{engine}", _events(engine, range(first, first + chains))


def measure_costs(blocks: int, engines: int, sources: dict[str, str | None]) -> None:
    """Applying the events and a lookup in the full index, the indexes side by side in this
    process (each event applied to each in turn, lookups alternating), so that a machine whose
    load changes weighs on all alike."""
    print(
        f"\n| index | {blocks:,} blocks, {engines} engines | apply µs/block | "
        "longest prefix ms (1024 tokens, full index) |"
    )
    print("|---|---|---:|---:|")
    tokens = list(_chain_tokens(0))  # engine 0 holds it all; with "shared", every engine
    for scenario, label in _SCENARIOS.items():
        indexes = {name: _index_class(src)(max_blocks=blocks) for name, src in sources.items()}
        cpu = dict.fromkeys(indexes, 0.0)
        for engine, events in _engines_events(scenario, blocks, engines):
            for event in events:
                for name, index in indexes.items():
                    start = time.process_time()
                    index.apply(engine, [event])
                    cpu[name] += time.process_time() - start
        lookups = _side_by_side(
            {
                name: functools.partial(index.longest_prefix, tokens)
                for name, index in indexes.items()
            },
            300,
        )
        for name, index in indexes.items():
            print(
                f"| {name} | {label} | {cpu[name] / index.blocks * 1e6:.2f} | {lookups[name]:.3f} |"
            )
        del indexes


def _sources(compare: str | None) -> dict[str, str | None]:
    """The indexes to measure, by label: another ref's index.py (as a file), and this tree's."""
    if not compare:
        return {"this tree": None}
    old = Path(tempfile.mkdtemp()) / "index.py"
    shown = subprocess.run(
        ["git", "show", f"{compare}:extproc/kvcache/index.py"],
        capture_output=True,
        text=True,
        check=True,
    )
    old.write_text(shown.stdout)
    return {compare: str(old), "this tree": None}


def measure_memory(blocks: int, engines: int, sources: dict[str, str | None]) -> None:
    print(
        f"| index | blocks, {engines} engines | traced MiB | bytes/block | RSS growth MiB | "
        "estimate MiB |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for scenario, label in _SCENARIOS.items():
        for name, source in sources.items():
            cells = [_cell_in_child(source, scenario, blocks, engines, t) for t in (True, False)]
            traced, rss = cells
            print(
                f"| {name} | {traced['blocks']:,}, {label} | {traced['bytes'] / 2**20:.1f} | "
                f"{traced['bytes'] / traced['blocks']:.0f} | {rss['bytes'] / 2**20:.1f} | "
                f"{traced['estimate'] / 2**20:.1f} |"
            )


def _cell_in_child(
    source: str | None, scenario: str, blocks: int, engines: int, traced: bool
) -> dict[str, Any]:
    args = json.dumps([source, scenario, blocks, engines, traced])
    out = subprocess.run(
        [sys.executable, "-m", "bench.kv_index", "--cell", args],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def _timed(fn: Callable[[], object], repeat: int) -> float:
    return _side_by_side({"": fn}, repeat)[""]


def _side_by_side(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median ms of each, their runs alternating."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


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


def measure_request_cost(
    tokenizer_dir: Path | None, engines: int, sources: dict[str, str | None]
) -> None:
    rng = random.Random(11)
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
    indexes = {
        label: _index_class(source)(max_blocks=1_000_000) for label, source in sources.items()
    }
    for index in indexes.values():
        for i in range(engines):  # engine i holds the first (i + 1) / engines of the prompt
            n = held * (i + 1) // engines
            hashes = tuple(range(1 + i * 1000, 1 + i * 1000 + n))
            stored = BlocksStored(hashes, None, tuple(ids[: n * _BLOCK]), _BLOCK, True)
            index.apply(f"engine-{i}", [stored])
    lookups = _side_by_side(
        {label: functools.partial(index.longest_prefix, ids) for label, index in indexes.items()},
        500,
    )
    for label, ms in lookups.items():
        print(f"| longest prefix, {engines} engines (one holds it all), {label} | {ms:.3f} |")


def _stored_event(first: int, blocks: int, parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [(first + i).to_bytes(32, "big") for i in range(blocks)],
        "parent_block_hash": None if parent is None else parent.to_bytes(32, "big"),
        "token_ids": tokens,
        "block_size": len(tokens) // blocks,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def _large_batches() -> dict[str, bytes]:
    """Batches as a hostile publisher (or a very large engine step) would send them."""
    long = 1 << 18  # the longest event the decoder takes
    batches = {
        "65 536 BlockRemoved": [
            {"type": "BlockRemoved", "block_hashes": [i.to_bytes(32, "big")], "medium": "GPU"}
            for i in range(65_536)
        ],
        "30 000 BlockStored of 2 blocks": [
            _stored_event(10 + 2 * i, 2, None, [(i + t) % 50_000 for t in range(2 * _BLOCK)])
            for i in range(30_000)
        ],
        "4 BlockStored of 2**18 tokens, one chain": [
            _stored_event(
                10 + n * long // _BLOCK,
                long // _BLOCK,
                9 + n * long // _BLOCK if n else None,
                [(t + n) % 50_000 for t in range(long)],
            )
            for n in range(4)
        ],
        "35 000 BlockStored of 2 blocks (over the bound)": [
            _stored_event(10 + 2 * i, 2, None, [(i + t) % 50_000 for t in range(2 * _BLOCK)])
            for i in range(35_000)
        ],
    }
    return {name: msgpack.packb([time.time(), events, 0]) for name, events in batches.items()}


async def _applied_with_the_loop_watched(payload: bytes) -> tuple[float, float]:
    """One batch through an engine's subscriber (no sockets): the event loop's longest stall
    meanwhile, and the wall time until the batch is applied."""
    index = KvIndex(max_blocks=1_000_000)
    events = EngineEvents("e", "tcp://127.0.0.1:1", index, Metrics())
    worst = 0.0

    async def tick() -> None:
        nonlocal worst
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - before - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    await events.on_message([b"", (0).to_bytes(8, "big"), payload])
    wall = time.perf_counter() - started
    ticker.cancel()
    return worst, wall


def measure_event_stalls() -> None:
    """A large KV event batch: the loop held by decoding and applying it in one call (as
    before the slices), against the subscriber's longest stall and its wall time."""
    print("\n| batch | MB | one call: loop held, s | subscriber: longest stall, ms | wall, s |")
    print("|---|---:|---:|---:|---:|")
    for name, payload in _large_batches().items():
        index = KvIndex(max_blocks=1_000_000)
        started = time.perf_counter()
        with contextlib.suppress(MalformedBatch):
            index.apply("e", decode_batch(payload).events)
        one_call = time.perf_counter() - started
        worst, wall = asyncio.run(_applied_with_the_loop_watched(payload))
        mb = len(payload) / 1e6
        print(f"| {name} | {mb:.1f} | {one_call:.2f} | {worst * 1e3:.0f} | {wall:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument(
        "--tokenizer", type=Path, default=Path.home() / ".cache/pd-extproc/tiny-llama"
    )
    parser.add_argument("--compare", metavar="REF", help="also measure the index.py of REF")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # one memory cell, in a child
    parser.add_argument(
        "--event-stalls", action="store_true", help="only the table of large KV event batches"
    )
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(memory_cell(*json.loads(args.cell))))
        return
    if args.event_stalls:
        measure_event_stalls()
        return
    sources = _sources(args.compare)
    measure_memory(args.blocks, args.engines, sources)
    measure_costs(args.blocks, args.engines, sources)
    tok = args.tokenizer if (args.tokenizer / "tokenizer.json").is_file() else None
    measure_request_cost(tok, args.engines, sources)


if __name__ == "__main__":
    main()
