"""One load view across the ext_proc processes of a sidecar (`extproc.workers` above 1).

Each process counts the requests it has in flight at each endpoint, the prompt tokens of them
the engine lacked (`pending_tokens`), the tokens of its P legs there (`queued_tokens`) and, on
a decode engine, the prompts the decision sent it to prefill alone that it may not have
prefilled yet (`alone_tokens`, until the last of them is due) and the decision's stall bucket
there as this process last left it (its credit, and when). The bucket is one per D for the
whole sidecar: a process carries on from the latest one told (its own or another's), so that N
processes spend one budget, not N.
Alone, each would see about 1/N of the load its siblings put on an engine and pile its share
onto the engine that holds a prefix. Here every process publishes its counts in a table all of
them map (a file in `up`'s run directory): one row per process, each written only by its owner,
so the hot path takes no lock; a reader sums the other rows' counts for an endpoint (its
`peer_*` figures).

A row is a heartbeat (the owner's monotonic clock, ns) and `SLOTS` slots of (key, in flight,
pending tokens, queued tokens, alone tokens, when those are all due in ns, the stall bucket's
credit in µs and its time in ns), the key a hash of
the endpoint's role and address, found by linear probing from the key. Values are aligned
8-byte words, each written in one store; a reader may see one count of a change before the
next (an estimate, as the scraped load is).

A process that dies leaves its row: its heartbeat (refreshed every `BEAT_S` by a task, and at
each change) then ages, and a row whose heartbeat is older than `STALE_S` counts for nothing.
A process that starts (a restarted worker takes its predecessor's row) clears its row first.
Memory is fixed: rows × (1 + 8 × SLOTS) words (64 KiB a row). An endpoint that finds no free
slot (more than SLOTS in one row's history) has the row rebuilt with the endpoints counted
now; past SLOTS live endpoints, the others are not shared.
"""

from __future__ import annotations

import asyncio
import hashlib
import mmap
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from extproc.roles import Role
from extproc.stopping import cancel_and_wait

__all__ = ["BEAT_S", "SLOTS", "STALE_S", "PeerLoad", "SharedLoad", "table_bytes"]

SLOTS = 1024  # endpoints per row: more than any pool this sidecar fronts
BEAT_S = 1.0  # how often an owner refreshes its heartbeat
STALE_S = 5.0  # a row not refreshed for this long is a dead process's: ignored
_WORD = 8
# key, in flight, pending, queued, alone tokens, when they are due (ns), bucket (µs), its time (ns)
_FIELDS = 8
_ROW_WORDS = 1 + _FIELDS * SLOTS


def table_bytes(rows: int) -> int:
    return rows * _ROW_WORDS * _WORD


@dataclass(frozen=True, slots=True)
class PeerLoad:
    """The other processes' counts at one endpoint."""

    in_flight: int = 0
    pending_tokens: int = 0
    queued_tokens: int = 0
    alone_tokens: int = 0
    # decode: the decision's stall bucket as the latest of them left it (at_ns 0: none told)
    stall_credit_us: int = 0
    stall_at_ns: int = 0


_NONE = PeerLoad()


def _key(role: Role, address: str) -> int:
    """A non-zero signed 64-bit word for the endpoint (0 marks an empty slot)."""
    digest = hashlib.blake2b(f"{role}/{address}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


class SharedLoad:
    def __init__(
        self,
        buffer: memoryview | bytearray | mmap.mmap,
        rows: int,
        row: int,
        clock: Callable[[], float],
    ) -> None:
        """`buffer`: the table (`table_bytes(rows)` bytes, zeroed or written by this format);
        `row`: this process's; `clock`: monotonic seconds, the same in every process."""
        if not 0 <= row < rows:
            raise ValueError(f"row {row} is not one of {rows}")
        self._words = memoryview(buffer).cast("B").cast("q")
        if len(self._words) < rows * _ROW_WORDS:
            raise ValueError(f"the shared load table holds fewer than {rows} rows")
        self.rows, self.row = rows, row
        self._clock = clock
        self._keys: dict[tuple[Role, str], int] = {}  # endpoint → its key, hashed once
        self._own: dict[int, int] = {}  # key → its slot's first word in this row
        self._found: dict[tuple[int, int], int] = {}  # (row, key) → a slot seen holding key
        self._task: asyncio.Task[None] | None = None
        self._base = row * _ROW_WORDS
        self._words[self._base : self._base + _ROW_WORDS] = memoryview(
            bytes(_ROW_WORDS * _WORD)
        ).cast("q")
        self.beat()

    @classmethod
    def create(cls, path: Path, rows: int, clock: Callable[[], float]) -> SharedLoad:
        """The table for `rows` processes, made anew at `path`; this process takes row 0."""
        path.write_bytes(bytes(table_bytes(rows)))
        return cls.open(path, rows, 0, clock)

    @classmethod
    def open(cls, path: Path, rows: int, row: int, clock: Callable[[], float]) -> SharedLoad:
        with path.open("r+b") as file:  # the mapping outlives the file object
            mapped = mmap.mmap(file.fileno(), table_bytes(rows))
        return cls(mapped, rows, row, clock)

    def _key(self, role: Role, address: str) -> int:
        key = self._keys.get((role, address))
        if key is None:
            if len(self._keys) >= 2 * SLOTS:
                self._keys.clear()  # bounded: endpoints that left are hashed again if back
            key = self._keys[(role, address)] = _key(role, address)
        return key

    # -- this process's row ----------------------------------------------------------------

    def beat(self) -> None:
        self._words[self._base] = int(self._clock() * 1e9)

    def publish(
        self, role: Role, address: str, in_flight: int, pending_tokens: int, queued_tokens: int
    ) -> None:
        """This process's counts at the endpoint, now."""
        key = self._key(role, address)
        slot = self._own.get(key)
        if slot is None:
            if not (in_flight or pending_tokens or queued_tokens):
                return  # nothing to say: no slot taken
            slot = self._claim(key)
            if slot is None:
                return  # the row is full of live endpoints: this one is not shared
        words = self._words
        words[slot + 1], words[slot + 2], words[slot + 3] = in_flight, pending_tokens, queued_tokens
        self.beat()  # alive, whether or not its heartbeat's task runs yet

    def publish_alone(
        self,
        role: Role,
        address: str,
        tokens: int,
        due: float,
        stall_credit_ms: float = 0.0,
        stall_at: float = 0.0,
    ) -> None:
        """The prompts this process sent the engine to prefill alone: `tokens` of them, the
        last due (prefilled, as the decision expects) at `due` on the clock; and its stall
        bucket there, `stall_credit_ms` at `stall_at` on the clock (0: none)."""
        key = self._key(role, address)
        slot = self._own.get(key)
        if slot is None:
            if not (tokens or stall_at):
                return
            slot = self._claim(key)
            if slot is None:
                return
        words = self._words
        words[slot + 5], words[slot + 6] = int(due * 1e9), round(stall_credit_ms * 1e3)
        words[slot + 7] = int(stall_at * 1e9)
        words[slot + 4] = tokens
        self.beat()

    def _claim(self, key: int) -> int | None:
        slot = self._free_slot(key)
        if slot is None:
            self._rebuild()
            slot = self._free_slot(key)
            if slot is None:
                return None
        self._words[slot] = key
        self._own[key] = slot
        return slot

    def _free_slot(self, key: int) -> int | None:
        words, start = self._words, key % SLOTS
        for step in range(SLOTS):
            slot = self._base + 1 + ((start + step) % SLOTS) * _FIELDS
            if words[slot] == 0:
                return slot
        return None

    def _rebuild(self) -> None:
        """The row with only the endpoints counted now (others left slots behind)."""
        words = self._words
        live = {
            key: tuple(words[slot + 1 : slot + _FIELDS])
            for key, slot in self._own.items()
            if any(words[slot + 1 : slot + _FIELDS])
        }
        words[self._base + 1 : self._base + _ROW_WORDS] = memoryview(
            bytes((_ROW_WORDS - 1) * _WORD)
        ).cast("q")
        self._own = {}
        for key, counts in live.items():
            slot = self._free_slot(key)
            if slot is None:  # cannot happen: fewer live than slots
                break
            words[slot + 1 : slot + _FIELDS] = memoryview(array("q", counts))
            words[slot] = key
            self._own[key] = slot

    # -- the others' rows --------------------------------------------------------------------

    def peers(self, role: Role, address: str) -> PeerLoad:
        """The sum of the other live processes' counts at the endpoint."""
        if self.rows == 1:
            return _NONE
        key, words = self._key(role, address), self._words
        now = int(self._clock() * 1e9)
        oldest = now - int(STALE_S * 1e9)
        in_flight = pending = queued = alone = credit = at = 0
        for row in range(self.rows):
            if row == self.row or words[row * _ROW_WORDS] < oldest:
                continue
            slot = self._slot_in(row, key)
            if slot is not None:
                in_flight += words[slot + 1]
                pending += words[slot + 2]
                queued += words[slot + 3]
                if words[slot + 5] > now:
                    alone += words[slot + 4]
                if words[slot + 7] > at:  # the latest bucket told
                    credit, at = words[slot + 6], words[slot + 7]
        if in_flight or pending or queued or alone or at:
            return PeerLoad(in_flight, pending, queued, alone, credit, at)
        return _NONE

    def _slot_in(self, row: int, key: int) -> int | None:
        words = self._words
        slot = self._found.get((row, key))
        if slot is not None and words[slot] == key:
            return slot
        base, start = row * _ROW_WORDS + 1, key % SLOTS
        for step in range(SLOTS):
            slot = base + ((start + step) % SLOTS) * _FIELDS
            found = words[slot]
            if found == key:
                if len(self._found) >= self.rows * SLOTS:
                    self._found.clear()  # bounded: rows' rebuilds leave stale places
                self._found[(row, key)] = slot
                return slot
            if found == 0:
                return None
        return None

    # -- the heartbeat's task ----------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._beat(), name="shared load heartbeat")

    async def _beat(self) -> None:
        while True:
            self.beat()
            await asyncio.sleep(BEAT_S)

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
