"""The table `up`'s ext_proc processes share their load through: each writes its own row, each
reads the others', a dead process's row stops counting, a restarted one starts clean, and the
memory is fixed whatever the endpoints."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extproc.roles import Role
from extproc.scheduling.shared_load import (
    SLOTS,
    STALE_S,
    PeerLoad,
    SharedLoad,
    _key,
    table_bytes,
)

P, D = Role.PREFILL, Role.DECODE


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rows(count: int, clock: Clock) -> list[SharedLoad]:
    table = bytearray(table_bytes(count))
    return [SharedLoad(table, count, row, clock) for row in range(count)]


def test_each_process_sees_the_sum_of_the_others_counts_not_its_own() -> None:
    a, b, c = rows(3, Clock())
    a.publish(P, "p0", 2, 300, 40)
    b.publish(P, "p0", 1, 100, 0)
    b.publish(D, "p0", 5, 5, 5)  # another role: another endpoint
    assert c.peers(P, "p0") == PeerLoad(3, 400, 40)
    assert a.peers(P, "p0") == PeerLoad(1, 100, 0)
    assert a.peers(D, "p0") == PeerLoad(5, 5, 5)
    assert a.peers(P, "p1") == PeerLoad()
    b.publish(P, "p0", 0, 0, 0)  # its requests ended
    assert c.peers(P, "p0") == PeerLoad(2, 300, 40)


def test_a_process_that_stops_beating_stops_counting_and_counts_again_once_it_beats() -> None:
    clock = Clock()
    a, b = rows(2, clock)
    a.publish(D, "d0", 4, 0, 0)
    clock.now += STALE_S - 0.5
    assert b.peers(D, "d0").in_flight == 4
    clock.now += 1.0  # a dead process's row: its counts no longer hold anything
    assert b.peers(D, "d0") == PeerLoad()
    a.beat()
    assert b.peers(D, "d0").in_flight == 4


def test_a_restarted_process_clears_the_row_its_predecessor_left() -> None:
    clock = Clock()
    table = bytearray(table_bytes(2))
    dead = SharedLoad(table, 2, 1, clock)
    dead.publish(P, "p0", 7, 700, 70)
    reader = SharedLoad(table, 2, 0, clock)
    assert reader.peers(P, "p0").in_flight == 7
    SharedLoad(table, 2, 1, clock)  # the new worker takes row 1
    assert reader.peers(P, "p0") == PeerLoad()


def test_prompts_sent_to_prefill_alone_count_until_they_are_due() -> None:
    clock = Clock()
    a, b = rows(2, clock)
    a.publish_alone(D, "d0", 900, due=clock.now + 0.2)
    assert b.peers(D, "d0") == PeerLoad(alone_tokens=900)
    clock.now += 0.3
    assert b.peers(D, "d0") == PeerLoad()


def _address(n: int) -> str:
    return f"10.0.{n // 256}.{n % 256}:8000"


def test_endpoints_past_the_rows_slots_reuse_the_slots_of_those_that_left() -> None:
    """A churning discovery: 3 x SLOTS endpoints come one after another, each leaving (its
    requests ended) SLOTS / 2 arrivals later; the table never grows and every live one is
    still shared."""
    a, b = rows(2, Clock())
    size = len(a._words)
    live = SLOTS // 2
    for n in range(3 * SLOTS):
        a.publish(P, _address(n), 1, 10, 0)
        if n >= live:
            a.publish(P, _address(n - live), 0, 0, 0)
    assert len(a._words) == size
    for n in range(3 * SLOTS - live, 3 * SLOTS):
        assert b.peers(P, _address(n)) == PeerLoad(1, 10, 0)
    assert b.peers(P, _address(0)) == PeerLoad()


def test_a_table_that_is_too_small_or_a_row_outside_it_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than 3 rows"):
        SharedLoad(bytearray(table_bytes(2)), 3, 0, Clock())
    with pytest.raises(ValueError, match="row 2 is not one of 2"):
        SharedLoad(bytearray(table_bytes(2)), 2, 2, Clock())


_WORKER = """
import sys, time
from pathlib import Path
from extproc.roles import Role
from extproc.scheduling.shared_load import SharedLoad
table = SharedLoad.open(Path(sys.argv[1]), 2, 1, time.monotonic)
table.publish(Role.DECODE, "d0", 3, 120, 0)
print("published", flush=True)
sys.stdin.readline()  # alive until told
"""


def test_processes_share_the_table_through_its_file(tmp_path: Path) -> None:
    """`up` makes the file; each worker maps it: another process's counts are read here."""
    path = tmp_path / "load.table"
    main = SharedLoad.create(path, 2, time.monotonic)
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "published\n"
        assert main.peers(Role.DECODE, "d0") == PeerLoad(3, 120, 0)
    finally:
        worker.communicate("\n", timeout=10)


async def test_the_heartbeat_task_is_owned_and_ends_on_stop() -> None:
    loop = asyncio.get_running_loop()
    table = bytearray(table_bytes(2))
    beating = SharedLoad(table, 2, 0, loop.time)
    beating.start()
    assert beating._task is not None and not beating._task.done()
    task = beating._task
    await beating.stop()
    assert task.done() and beating._task is None


def _colliding(role: Role) -> tuple[str, str]:
    """Two endpoints whose keys start probing at the same slot of a row."""
    first: dict[int, str] = {}
    for n in range(100 * SLOTS):
        address = _address(n)
        start = _key(role, address) % SLOTS
        if start in first:
            return first[start], address
        first[start] = address
    raise AssertionError("no two keys share a slot")


def test_endpoints_whose_keys_share_a_slot_are_each_found() -> None:
    """Linear probing: the second takes the next slot, where the readers look for it, and a
    reader's memo of where a key was does not outlive a restart that put another key there."""
    clock = Clock()
    table = bytearray(table_bytes(2))
    reader, writer = SharedLoad(table, 2, 0, clock), SharedLoad(table, 2, 1, clock)
    first, second = _colliding(P)
    writer.publish(P, first, 1, 10, 0)
    writer.publish(P, second, 2, 20, 0)
    assert reader.peers(P, first) == PeerLoad(1, 10, 0)
    assert reader.peers(P, second) == PeerLoad(2, 20, 0)
    restarted = SharedLoad(table, 2, 1, clock)  # its row clean: `second` now in `first`'s slot
    restarted.publish(P, second, 3, 30, 0)
    assert reader.peers(P, first) == PeerLoad()
    assert reader.peers(P, second) == PeerLoad(3, 30, 0)


def test_a_full_row_is_rebuilt_with_every_endpoint_still_counted() -> None:
    """A row whose slots all went to endpoints that came and left is rebuilt for a new one:
    those counted now keep their counts, whichever of them is not zero."""
    clock = Clock()
    reader, writer = rows(2, clock)  # the writer's row is the table's second
    writer.publish(D, "in-flight", 1, 0, 0)
    writer.publish(D, "pending", 0, 5, 0)
    writer.publish(D, "queued", 0, 0, 7)
    writer.publish_alone(D, "alone", 9, due=clock.now + 10)
    for n in range(SLOTS - 4):  # the rest of the row: endpoints that came and left
        writer.publish(D, _address(n), 1, 0, 0)
        writer.publish(D, _address(n), 0, 0, 0)
    writer.publish(D, "new", 2, 0, 0)  # no free slot: the row is rebuilt
    assert reader.peers(D, "new") == PeerLoad(2)
    assert reader.peers(D, "in-flight") == PeerLoad(1)
    assert reader.peers(D, "pending") == PeerLoad(pending_tokens=5)
    assert reader.peers(D, "queued") == PeerLoad(queued_tokens=7)
    assert reader.peers(D, "alone") == PeerLoad(alone_tokens=9)
    assert reader.peers(D, _address(0)) == PeerLoad()


def test_the_memos_of_keys_and_slots_stay_bounded_whatever_the_churn() -> None:
    reader, writer = rows(2, Clock())
    for n in range(3 * SLOTS):
        writer.publish(P, _address(n), 1, 0, 0)
        assert reader.peers(P, _address(n)) == PeerLoad(1)
        writer.publish(P, _address(n), 0, 0, 0)
        assert len(writer._keys) <= 2 * SLOTS and len(reader._keys) <= 2 * SLOTS
        assert len(reader._found) <= 2 * SLOTS


def test_a_row_counts_until_it_is_older_than_stale_s_and_alone_tokens_until_due() -> None:
    clock = Clock()
    a, b = rows(2, clock)
    a.publish_alone(D, "d0", 900, due=clock.now + 0.5)
    a.publish(D, "d0", 1, 0, 0)
    clock.now += 0.5  # due now: no longer ahead
    assert b.peers(D, "d0") == PeerLoad(1)
    clock.now = 100.0 + STALE_S  # exactly STALE_S old: still alive
    assert b.peers(D, "d0") == PeerLoad(1)


def test_alone_tokens_of_several_processes_add_up() -> None:
    clock = Clock()
    a, b, c = rows(3, clock)
    a.publish_alone(D, "d0", 900, due=clock.now + 1)
    b.publish_alone(D, "d0", 100, due=clock.now + 1)
    assert c.peers(D, "d0") == PeerLoad(alone_tokens=1000)


def test_the_latest_stall_bucket_told_is_the_others_until_its_endpoint_is_forgotten() -> None:
    clock = Clock()
    a, b, c = rows(3, clock)
    a.publish_alone(D, "d0", 0, 0.0, stall_credit_ms=-1.5, stall_at=clock.now + 0.2)
    b.publish_alone(D, "d0", 100, due=clock.now + 1, stall_credit_ms=9.0, stall_at=clock.now)
    assert c.peers(D, "d0") == PeerLoad(
        alone_tokens=100, stall_credit_us=-1500, stall_at_ns=int((clock.now + 0.2) * 1e9)
    )
    a.publish_alone(D, "d0", 0, 0.0)  # a forgot d0: its slot holds nothing now
    assert c.peers(D, "d0") == PeerLoad(
        alone_tokens=100, stall_credit_us=9000, stall_at_ns=int(clock.now * 1e9)
    )
    assert not any(a._words[a._own[a._key(D, "d0")] + 1 :][:7])


def test_a_publish_is_a_heartbeat() -> None:
    clock = Clock()
    a, b = rows(2, clock)
    clock.now += 2 * STALE_S  # a quiet process, its heartbeat's task not run yet
    a.publish(P, "p0", 1, 0, 0)
    assert b.peers(P, "p0") == PeerLoad(1)
    clock.now += 2 * STALE_S
    a.publish_alone(P, "p0", 5, due=clock.now + 1)
    assert b.peers(P, "p0") == PeerLoad(1, alone_tokens=5)


class CountingClock(Clock):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now


async def test_the_heartbeat_task_beats_at_once_then_waits_beat_s() -> None:
    clock = CountingClock()
    beating, reader = rows(2, clock)
    beating.publish(D, "d0", 1, 0, 0)
    clock.now += 2 * STALE_S  # stale until the task beats
    assert reader.peers(D, "d0") == PeerLoad()
    calls = clock.calls
    beating.start()
    beating.start()  # once only: the task it has
    for _ in range(20):
        await asyncio.sleep(0)
    try:
        assert clock.calls == calls + 1  # one beat, then asleep for BEAT_S (not spinning)
        assert beating._task is not None and not beating._task.done()
        assert reader.peers(D, "d0") == PeerLoad(1)
    finally:
        await beating.stop()
