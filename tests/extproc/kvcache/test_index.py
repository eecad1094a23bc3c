"""The KV index: chains keyed by tokens, per-engine longest prefixes, removal, clearing, and its
bound under a flood of blocks; its memory and the estimate of it."""

from __future__ import annotations

import gc
import random
import tracemalloc
from array import array

import pytest

from extproc.kvcache.events import AllCleared, BlocksRemoved, BlocksStored
from extproc.kvcache.index import KvIndex, _mixed, chain_keys
from extproc.kvcache.scope import PLAIN, CacheScope

TOKENS = list(range(100, 132))  # 8 blocks of 4


def store(
    hashes: list[int],
    tokens: list[int],
    parent: int | None = None,
    size: int = 4,
    plain: bool = True,
) -> BlocksStored:
    return BlocksStored(tuple(hashes), parent, tuple(tokens), size, plain)


def test_longest_prefix_counts_leading_blocks_per_engine() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2, 3], TOKENS[:12])])
    index.apply("b", [store([9], TOKENS[:4]), store([8, 7], TOKENS[4:12], parent=9)])
    index.apply("c", [store([5], TOKENS[4:8])])  # block 2 alone: not a prefix
    index.add_engine("d")
    assert index.longest_prefix(TOKENS) == {"a": 3, "b": 3, "c": 0, "d": 0}
    assert index.longest_prefix(TOKENS[:10]) == {"a": 2, "b": 2, "c": 0, "d": 0}
    other = [*TOKENS[:4], 0, *TOKENS[5:]]
    assert index.longest_prefix(other) == {"a": 1, "b": 1, "c": 0, "d": 0}


def test_keys_depend_on_the_whole_prefix_not_the_block_alone() -> None:
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != chain_keys([0, 0, 0, 0, 5, 6, 7, 8], 4)[1]
    assert chain_keys(TOKENS, 4) == chain_keys([*TOKENS, 1, 2], 4)
    assert len(chain_keys(TOKENS, 4, limit=3)) == 3


def test_a_removed_block_ends_the_prefix_there() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2, 3], TOKENS[:12])])
    index.apply("a", [BlocksRemoved((2,))])
    assert index.longest_prefix(TOKENS) == {"a": 1}
    assert index.blocks == 2


def test_shared_blocks_stay_for_the_engine_that_still_holds_them() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2], TOKENS[:8])])
    index.apply("b", [store([11, 12], TOKENS[:8])])
    assert index.distinct_blocks == 2 and index.blocks == 4
    index.clear_engine("a")
    assert index.longest_prefix(TOKENS) == {"a": 0, "b": 2}
    index.apply("b", [AllCleared()])
    assert index.longest_prefix(TOKENS) == {"a": 0, "b": 0}
    assert index.blocks == 0 and index.distinct_blocks == 0


def test_blocks_without_a_known_parent_or_keyed_by_more_than_tokens_are_not_indexed() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([2], TOKENS[4:8], parent=1), store([3], TOKENS[:4], plain=False)])
    assert index.blocks == 0 and index.orphans == 2


def test_engines_with_other_block_sizes_are_looked_up_by_their_own() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2], TOKENS[:8])])
    index.apply("big", [store([1], TOKENS[:16], size=16)])
    assert index.longest_prefix(TOKENS) == {"a": 2, "big": 1}


def test_a_removed_engine_leaves_the_index_and_its_slot_is_reused() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1, 2], TOKENS[:8])])
    index.apply("b", [store([1], TOKENS[:4])])
    index.remove_engine("a")
    assert index.engines() == ["b"] and index.blocks == 1
    index.apply("c", [store([1], TOKENS[:4])])  # takes a's bit: must not inherit a's blocks
    assert index.longest_prefix(TOKENS) == {"b": 1, "c": 1}


def test_the_bound_holds_under_a_flood_and_evicts_the_oldest_stored() -> None:
    index = KvIndex(max_blocks=1000)
    rng = random.Random(3)
    first = [rng.randrange(1000) for _ in range(32)]
    index.apply("a", [store(list(range(1, 9)), first)])
    next_hash = 100
    for n in range(2000):  # 16 000 blocks over two engines
        tokens = [rng.randrange(1000) for _ in range(32)]
        if n % 50 == 0:  # `first` reused now and then: vLLM stores it again, so it stays
            index.apply("a", [store(list(range(1, 9)), first)])
        index.apply("ab"[n % 2], [store(list(range(next_hash, next_hash + 8)), tokens)])
        next_hash += 8
        assert index.blocks <= 1000
    assert index.blocks == 1000 and index.evicted == 15_008  # 16 008 stored: those over go
    assert index.longest_prefix(first)["a"] == 8
    assert index.bytes_estimate() < 1000 * 400


def test_a_block_stored_again_under_another_chain_moves() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("a", [store([1], TOKENS[:4])])
    index.apply("a", [store([1], TOKENS[4:8])])  # the engine reused its hash for other tokens
    assert index.longest_prefix(TOKENS) == {"a": 0}
    assert index.longest_prefix(TOKENS[4:]) == {"a": 1}
    assert index.blocks == 1 and index.distinct_blocks == 1


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        KvIndex(max_blocks=0)


def chains(engine: int, first: int, count: int, blocks: int = 16) -> list[BlocksStored]:
    """`count` prompts of `blocks` blocks of 16 tokens (prompt n's tokens seeded by n), with
    engine hashes of the engine's own."""
    rng = random.Random(f"{engine}-{first}")
    events = []
    for n in range(first, first + count):
        tokens = tuple(array("H", random.Random(n).randbytes(blocks * 16 * 2)))
        hashes = tuple(rng.getrandbits(60) for _ in range(blocks))
        events.append(BlocksStored(hashes, None, tokens, 16, True))
    return events


@pytest.mark.parametrize(
    ("shared", "bound"),
    [(False, 10**6), (True, 10**6), (False, 12_800)],
    ids=["no block shared", "all on every engine", "past the bound"],
)
def test_a_sizeable_index_is_compact_and_its_estimate_is_what_it_takes(
    shared: bool, bound: int
) -> None:
    prompts = 400  # 4 engines x 400 prompts x 16 blocks: 25 600 entries
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = KvIndex(max_blocks=bound)
        for engine in range(4):
            first = 0 if shared else engine * prompts
            for n in range(first, first + prompts):  # made one at a time: not kept
                index.apply(f"e{engine}", chains(engine, n, 1))
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.blocks == min(bound, 4 * prompts * 16)
    assert index.distinct_blocks == index.blocks // (4 if shared else 1)
    assert traced / index.blocks < 60  # bytes an entry; dicts of ints took 125-175
    assert abs(index.bytes_estimate() - traced) <= 0.2 * traced


def test_a_flood_of_blocks_stored_again_keeps_the_index_small_and_in_use_order() -> None:
    index = KvIndex(max_blocks=6400)
    cold, hot = chains(0, 0, 10, blocks=10), chains(0, 10, 100)  # 100 and 1600 blocks
    index.apply("a", [*cold, *hot])
    small = index.bytes_estimate()
    for n in range(300):  # 240 000 blocks stored again, the cold ones never
        index.apply("a", hot[n % 50 : n % 50 + 50])
    assert index.blocks == 1700 and index.bytes_estimate() < 2 * small
    index.apply("a", chains(0, 200, 300))  # 4800 new blocks: 100 over the bound
    assert index.blocks == 6400 and index.evicted == 100
    held = [index.longest_prefix(list(e.token_ids))["a"] for e in (*cold, *hot)]
    assert held[:10] == [0] * 10  # the oldest stored went first ...
    assert held[10:] == [16] * 100  # ... not those stored again since


def test_more_engines_than_a_byte_of_mask_holds() -> None:
    index = KvIndex(max_blocks=10_000)
    widths = {}
    for n in range(70):  # masks widen from 8 bits to 16, 32, 64 and Python ints
        index.apply(f"e{n}", [store([n + 1, n + 2], TOKENS[: 4 * (1 + n % 2)])])
        widths[n + 1] = index._holders._codes[0]  # the test looks inside: the masks' type
    assert [widths[n] for n in (8, 9, 16, 17, 32, 33, 64, 65)] == [*"BHHIIQQ", "list"]
    found = index.longest_prefix(TOKENS)
    assert [found[f"e{n}"] for n in range(70)] == [1 + n % 2 for n in range(70)]
    for n in range(0, 70, 2):
        index.remove_engine(f"e{n}")
    assert set(index.longest_prefix(TOKENS).values()) == {2}
    assert index.blocks == 70 and index.distinct_blocks == 2


def test_the_index_agrees_with_a_plain_model_of_it_through_random_events() -> None:
    """Stores (with parents, and stored again), removals, clearings and engines leaving,
    against dicts of token prefixes; enough blocks that the maps split and merge their
    buckets. An engine names a prefix by one hash, as vLLM does."""
    rng = random.Random(5)
    index = KvIndex(max_blocks=1_000_000)
    model: dict[str, dict[int, tuple[int, ...]]] = {}  # engine -> its hash -> tokens from root
    names: dict[tuple[str, tuple[int, ...]], int] = {}  # (engine, prefix) -> its hash
    prompts = [[rng.randrange(50) for _ in range(4 * 12)] for _ in range(400)]
    for step in range(4000):
        engine = f"e{rng.randrange(3)}"
        held = model.setdefault(engine, {})
        roll = rng.random() + (0.4 if step >= 2400 else 0)  # growing, then shrinking
        if roll < 0.8:
            tokens = rng.choice(prompts)
            first = rng.randrange(6)
            parent = None
            if first:
                known = [h for h, t in held.items() if t == tuple(tokens[: 4 * first])]
                if not known:
                    first = 0
                else:
                    parent = known[0]
            blocks = range(first + 1, min(12, first + rng.randrange(1, 7)) + 1)
            prefixes = [tuple(tokens[: 4 * n]) for n in blocks]
            hashes = [names.setdefault((engine, p), len(names) + 1) for p in prefixes]
            index.apply(engine, [store(hashes, tokens[4 * first :], parent=parent)])
            held.update(zip(hashes, prefixes, strict=True))
        elif roll < 1.35 and held:
            gone = rng.sample(sorted(held), min(len(held), rng.randrange(1, 20)))
            index.apply(engine, [BlocksRemoved(tuple(gone))])
            for engine_hash in gone:
                del held[engine_hash]
        elif roll < 1.37:
            index.apply(engine, [AllCleared()])
            held.clear()
        else:
            index.remove_engine(engine)
            del model[engine]
        if step % 100 == 99:
            assert index.blocks == sum(len(h) for h in model.values())
            distinct = set().union(*(set(h.values()) for h in model.values()))
            assert index.distinct_blocks == len(distinct)
            for tokens in rng.sample(prompts, 20):
                expected = {}
                for name, engine_held in model.items():
                    prefixes = set(engine_held.values())
                    depth = 0
                    while depth < 12 and tuple(tokens[: 4 * (depth + 1)]) in prefixes:
                        depth += 1
                    expected[name] = depth
                assert index.longest_prefix(tokens) == expected


# ---- cache scopes: vLLM keys blocks by LoRA adapter and cache salt too -------------------------


def scoped(
    hashes: list[int],
    tokens: list[int],
    parent: int | None = None,
    lora: str | None = None,
    salt: str | None = None,
) -> BlocksStored:
    return BlocksStored(tuple(hashes), parent, tuple(tokens), 4, True, lora, salt)


SALTED, OTHER_SALT = CacheScope(salt="s"), CacheScope(salt="t")
ADAPTER, OTHER_ADAPTER = CacheScope(adapter="a"), CacheScope(adapter="b")


def test_a_salted_or_adapter_request_is_not_credited_with_plain_blocks() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("d", [store([1, 2, 3], TOKENS[:12])])
    assert index.longest_prefix(TOKENS) == {"d": 3}
    for scope in (SALTED, ADAPTER, CacheScope("a", "s")):
        assert index.longest_prefix(TOKENS, scope) == {"d": 0}
        assert index.cached_tokens(TOKENS, scope) == {"d": 0}


def test_salted_blocks_serve_only_their_own_salt() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("d", [scoped([1, 2], TOKENS[:8], salt="s"), scoped([3], TOKENS[8:12], parent=2)])
    assert index.longest_prefix(TOKENS, SALTED) == {"d": 3}  # the chain carries the salt on
    assert index.longest_prefix(TOKENS) == {"d": 0}
    assert index.longest_prefix(TOKENS, OTHER_SALT) == {"d": 0}
    assert index.longest_prefix(TOKENS, CacheScope("a", "s")) == {"d": 0}


def test_adapter_blocks_serve_only_their_own_adapter() -> None:
    index = KvIndex(max_blocks=100)
    index.apply("d", [scoped([1, 2], TOKENS[:8], lora="a")])
    index.apply("d", [scoped([3], TOKENS[8:12], parent=2, lora="a")])
    assert index.longest_prefix(TOKENS, ADAPTER) == {"d": 3}
    assert index.longest_prefix(TOKENS) == {"d": 0}
    assert index.longest_prefix(TOKENS, OTHER_ADAPTER) == {"d": 0}
    # A child stored under another adapter than its parent's is keyed as vLLM's hash is: by
    # its own adapter, so a request of the parent's adapter does not reach it.
    index.apply("d", [scoped([4], TOKENS[12:16], parent=3, lora="b")])
    assert index.longest_prefix(TOKENS, ADAPTER) == {"d": 3}


def test_keys_differ_by_scope_and_agree_within_one() -> None:
    keys = {scope: chain_keys(TOKENS, 4, scope=scope) for scope in (PLAIN, SALTED, ADAPTER)}
    assert keys[PLAIN] == chain_keys(TOKENS, 4)
    assert len({key for chain in keys.values() for key in chain}) == 3 * 8
    assert chain_keys(TOKENS, 4, scope=CacheScope(salt="s")) == keys[SALTED]


def test_the_epoch_changes_when_an_engines_entries_are_dropped() -> None:
    """What a batch applied in slices checks between two of them."""
    index = KvIndex(max_blocks=100)
    assert index.epoch("a") == -1
    index.add_engine("a")
    first = index.epoch("a")
    index.apply("a", [store([1, 2], TOKENS[:8])])
    assert index.epoch("a") == first  # applying events is no reset
    index.clear_engine("a")
    cleared = index.epoch("a")
    assert cleared != first
    index.clear_engine("a")  # even with nothing held
    assert index.epoch("a") not in (first, cleared)
    index.apply("a", [AllCleared()])
    assert index.epoch("a") not in (first, cleared)
    index.remove_engine("a")
    assert index.epoch("a") == -1
    index.add_engine("a")
    assert index.epoch("a") not in (-1, first, cleared)


def test_every_salt_and_every_adapter_keys_its_own_chain() -> None:
    tokens = list(range(16))
    scopes = [CacheScope(salt=f"s{n}") for n in range(40)]
    scopes += [CacheScope(adapter=f"a{n}") for n in range(40)]
    firsts = {chain_keys(tokens, 4, scope=scope)[0] for scope in scopes}
    assert len(firsts) == len(scopes)


def test_an_engine_is_heard_from_once_it_stores_a_block_of_any_size() -> None:
    index = KvIndex(max_blocks=100)
    index.add_engine("a")
    index.apply("b", [BlocksRemoved((1,)), AllCleared()])  # no block size in these
    assert not index.heard_from("a") and not index.heard_from("b")
    assert not index.heard_from("c")  # not in the index
    index.apply("a", [store([1], TOKENS[:1], size=1)])
    assert index.heard_from("a")


def test_the_storage_log_keeps_storage_order_in_bounded_chunks_through_compaction() -> None:
    """Blocks stored again (never from the newest chunk, so each move is exact) make stale
    records that compaction drops and merges away: after every event the live records run in
    storage order, no chunk outgrows its size and the log's count is what its chunks hold."""
    rng = random.Random(7)
    index = KvIndex(max_blocks=64 * 2)  # chunks of 2 records
    order: list[int] = []  # engine hashes, oldest stored first
    for step in range(600):
        if len(order) < 100 and (step % 3 or len(order) < 4):
            engine_hash = len(order) + 1
        else:
            engine_hash = rng.choice(order[:-2])  # older than the newest chunk: it moves
            order.remove(engine_hash)
        index.apply("a", [store([engine_hash], list(range(4 * engine_hash, 4 * engine_hash + 4)))])
        order.append(engine_hash)
        log = index._engines["a"]
        live = [m for chunk, records in log.chunks for m in records if log.live(m, chunk)]
        assert live == [_mixed(h) for h in order]
        assert max(len(records) for _, records in log.chunks) <= 2
        assert log.records == sum(len(records) for _, records in log.chunks)
    # 600 records logged; compaction keeps the log within twice the entries and 4 chunks
    assert index.blocks == 100 and index._engines["a"].records <= 2 * 100 + 4 * 2


def test_a_block_stored_again_while_in_the_newest_chunk_keeps_its_one_record() -> None:
    index = KvIndex(max_blocks=64 * 4)  # chunks of 4 records
    for _ in range(10):  # vLLM announces a block again at each reuse
        index.apply("a", [store([1], TOKENS[:4])])
    log = index._engines["a"]
    assert log.records == 1 and index.blocks == 1
    index.apply("a", [store([2, 3, 4, 5], TOKENS[:16])])  # the newest chunk is another now
    index.apply("a", [store([1], TOKENS[:4])])
    assert log.records == 6  # moved: a new record at the end, the old one stale


def test_a_cleared_engine_takes_what_a_new_one_does() -> None:
    index, fresh = KvIndex(max_blocks=100), KvIndex(max_blocks=100)
    index.apply("a", [store(list(range(1, 9)), TOKENS)])
    index.clear_engine("a")
    fresh.add_engine("a")
    assert index.blocks == 0 and index.bytes_estimate() == fresh.bytes_estimate()


def test_eviction_reads_the_oldest_records_off_the_log_and_keeps_none_it_read() -> None:
    index = KvIndex(max_blocks=64 * 4)  # chunks of 4 records
    blocks = [store([n], [n, n, n, n]) for n in range(1, 303)]
    index.apply("a", blocks)  # 46 over the bound: the 46 oldest go, their records with them
    assert index.blocks == 256 and index.evicted == 46
    assert index._engines["a"].records == 256
    assert [index.longest_prefix([n] * 4)["a"] for n in (46, 47)] == [0, 1]
    for _ in range(3):  # stored again: compaction takes over from where eviction left the log
        index.apply("a", blocks[46:])
    assert index.blocks == 256 and index._engines["a"].records <= 2 * 256 + 4 * 4


def test_compaction_keeps_pace_with_events_of_many_blocks() -> None:
    """Each event stores 48 blocks again (three chunks): compaction reads up to eight chunks
    a call, two records per record logged, so after every event the log is still within
    twice the entries and four chunks (reading one chunk a call, it would grow without end)."""
    index = KvIndex(max_blocks=64 * 16)  # chunks of 16 records
    prompts = chains(0, 0, 2, blocks=48)  # 96 blocks
    index.apply("a", prompts)
    log = index._engines["a"]
    for n in range(100):
        index.apply("a", [prompts[n % 2]])
        assert log.records <= 2 * 96 + 4 * 16, n


def test_a_scope_with_a_lone_surrogate_keys_its_own_chain() -> None:
    # a JSON string may escape half a surrogate pair: the scope is keyed, not refused
    for scope in ("salt", "adapter"):
        odd, other = CacheScope(**{scope: "\ud800"}), CacheScope(**{scope: "\ud801"})
        assert chain_keys(TOKENS, 4, scope=odd) == chain_keys(TOKENS, 4, scope=odd)
        assert chain_keys(TOKENS, 4, scope=odd) != chain_keys(TOKENS, 4, scope=other)


def test_chunk_ids_past_a_signed_int_and_through_their_wrap_keep_the_log() -> None:
    index = KvIndex(max_blocks=64 * 2)  # chunks of 2 records
    index.add_engine("a")
    log = index._engines["a"]
    log.next_chunk = 2**32 - 2  # the test looks inside: four billion chunks on
    blocks = [store([n], [n] * 4) for n in range(1, 9)]
    index.apply("a", blocks)
    assert [chunk for chunk, _ in log.chunks] == [2**32 - 2, 2**32 - 1, 0, 1]
    index.apply("a", blocks[:2])  # stored again: moved to a new chunk
    assert [index.longest_prefix([n] * 4)["a"] for n in range(1, 9)] == [1] * 8
    live = [m for chunk, records in log.chunks for m in records if log.live(m, chunk)]
    assert live == [_mixed(n) for n in (3, 4, 5, 6, 7, 8, 1, 2)]
