"""Which engine each routed prompt's blocks went to: what an engine that publishes no KV events
probably holds.

An approximation (it cannot see evictions), kept for engines the index knows nothing of, so that
the blocks of a prompt this sidecar sent there count as held. Keys are the index's keyed chain
at one block size (vLLM's default), in the prompt's cache scope (its LoRA adapter and cache
salt, as the engine keys its blocks): a prompt is credited only with what went there in its
own scope. Entries are (engine, block key), oldest routed first, at most `max_blocks`, the
oldest going first in batches, each marked once the prompt has reached the engine (`land`: its
request's answer came from there): the decision counts only those as what a D holds, since a
prompt still queued at its P is not on D yet.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

from extproc.kvcache.index import chain_keys
from extproc.kvcache.scope import PLAIN, CacheScope

__all__ = ["RoutedBlocks"]

BLOCK_SIZE = 16  # vLLM's default block size
_EVICT_FRACTION = 64


class RoutedBlocks:
    def __init__(self, max_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        self.max_blocks = max_blocks
        self.block_size = block_size
        # insertion order: oldest routed first; True once the prompt reached the engine
        self._routed: dict[tuple[str, int], bool] = {}
        self._per_engine: dict[str, int] = {}

    def keys(self, token_ids: Sequence[int], scope: CacheScope = PLAIN) -> list[int]:
        return chain_keys(token_ids, self.block_size, scope=scope)

    def remember(self, engine: str, keys: Sequence[int]) -> None:
        """`engine` was sent a prompt of these block keys."""
        routed, added = self._routed, 0
        for key in keys:
            entry = (engine, key)
            reached = routed.pop(entry, None)
            if reached is None:
                added += 1
            routed[entry] = bool(reached)  # last: the most recently routed
        self._per_engine[engine] = self._per_engine.get(engine, 0) + added
        if len(routed) > self.max_blocks:
            batch = max(len(routed) - self.max_blocks, self.max_blocks // _EVICT_FRACTION)
            self._drop(list(itertools.islice(routed, batch)))

    def _drop(self, entries: list[tuple[str, int]]) -> None:
        for entry in entries:
            del self._routed[entry]
            left = self._per_engine[entry[0]] - 1
            if left:
                self._per_engine[entry[0]] = left
            else:
                del self._per_engine[entry[0]]

    def engines(self) -> set[str]:
        return set(self._per_engine)

    def land(self, engine: str, keys: Sequence[int]) -> None:
        """The prompt of these keys, sent to `engine`, is there now (its place is kept)."""
        routed = self._routed
        for key in keys:
            if (engine, key) in routed:
                routed[(engine, key)] = True

    def held(
        self, keys: Sequence[int], engines: Collection[str], reached: bool = False
    ) -> dict[str, int]:
        """Per engine of `engines`, how many leading tokens of the prompt were routed to it
        (`reached`: that have reached it)."""
        found, routed = {}, self._routed
        for engine in engines:
            depth = 0
            for key in keys:
                there = routed.get((engine, key))
                if there is None or (reached and not there):
                    break
                depth += 1
            if depth:
                found[engine] = depth * self.block_size
        return found

    def forget(self, engine: str) -> None:
        if engine in self._per_engine:
            self._drop([e for e in self._routed if e[0] == engine])

    def __len__(self) -> int:
        return len(self._routed)
