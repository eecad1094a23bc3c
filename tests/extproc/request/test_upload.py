"""A streamed upload gathered whole: its bytes taken from the process's body budget chunk by
chunk, and what it costs in memory while it is held and once whole."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.request.body_budget import BodyBudget
from extproc.request.stream import EnvoyStream
from extproc.request.upload import UploadLimits, gather_body
from tests.support.scripted_envoy import ScriptedEnvoy

MIB = 1024 * 1024
LIMITS = UploadLimits(body_bytes=64 * MIB, budget_bytes=256 * MIB, idle_s=5, whole_s=5)
SLACK = 256 * 1024  # the interpreter's own allocations meanwhile
HELD = 1.05  # the chunks as they came, nothing beside them (a growing buffer: up to 1/8 more)
WHOLE = 2.0  # the chunks and their join, for the moment of the join


class Chunks:
    """Envoy's stream of body chunks; before handing out the next, it notes how much memory
    (traced) the gathering holds for the bytes it has been given so far."""

    def __init__(self, sizes: list[int], every: int = 1) -> None:
        self._messages = self._build(sizes)
        self.held_per_sent: list[tuple[int, int]] = []  # (traced bytes held, bytes sent)
        self._every = every  # chunks between two notes (the notes are traced too)
        self._reads = 0
        self._sent = 0
        self._base = 0

    def _build(self, sizes: list[int]) -> Iterator[ep.ProcessingRequest]:
        for i, size in enumerate(sizes):
            message = ep.ProcessingRequest()
            message.request_body.body = bytes([65 + i % 26]) * size  # freed: the message copies
            message.request_body.end_of_stream = i == len(sizes) - 1
            yield message

    def start(self) -> None:
        self._base = tracemalloc.get_traced_memory()[0]

    async def read(self) -> ep.ProcessingRequest:
        if self._sent and not self._reads % self._every:
            self.held_per_sent.append((tracemalloc.get_traced_memory()[0] - self._base, self._sent))
        self._reads += 1
        message = next(self._messages)
        self._sent += len(message.request_body.body)
        return message


async def gather(sizes: list[int], every: int = 1) -> tuple[Chunks, bytes, int]:
    """The chunks' record, the body, and the gathering's peak of traced memory over its start."""
    chunks = Chunks(sizes, every)
    tracemalloc.start()
    try:
        chunks.start()
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        stream = EnvoyStream(chunks)  # type: ignore[arg-type]
        upload = await gather_body(stream, LIMITS, BodyBudget().reservation())
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert upload is not None
    return chunks, upload.body, peak


async def test_a_held_upload_costs_what_it_has_sent() -> None:
    """Chunks of megabytes, as Envoy sends what it buffered: while the next one is awaited,
    the gathering holds what came (the chunks, not the last message beside them), and the
    whole body is one join of them."""
    sizes = [4 * MIB] * 4 + [1 * MIB] * 4
    chunks, body, peak = await gather(sizes)
    assert len(body) == sum(sizes) and body[: 4 * MIB] == b"A" * (4 * MIB)
    assert len(chunks.held_per_sent) == len(sizes) - 1
    for held, sent in chunks.held_per_sent:
        assert held <= HELD * sent + SLACK, (held, sent)
    assert peak <= WHOLE * len(body) + SLACK


async def test_many_small_chunks_are_gathered_in_proportion_too() -> None:
    sizes = [16 * 1024] * 640  # 10 MiB
    chunks, body, peak = await gather(sizes)
    assert len(body) == sum(sizes)
    for held, sent in chunks.held_per_sent:
        assert held <= HELD * sent + SLACK, (held, sent)
    assert peak <= WHOLE * len(body) + SLACK


async def test_tiny_chunks_are_held_in_proportion() -> None:
    """A client dripping bytes makes Envoy send tiny chunks: each kept as its own object would
    cost ~40 bytes for every few it holds."""
    sizes = [8] * 100_000  # 800 KB
    chunks, body, _ = await gather(sizes, every=10_000)
    assert len(body) == sum(sizes)
    assert len(chunks.held_per_sent) == 9
    for held, sent in chunks.held_per_sent:
        assert held <= HELD * sent + SLACK, (held, sent)


async def test_a_body_of_one_chunk_is_not_copied() -> None:
    _, body, peak = await gather([8 * MIB])
    assert len(body) == 8 * MIB
    assert peak <= 8 * MIB + SLACK  # the chunk itself, no second copy


CHUNK, CHUNKS = 100, 10


async def test_each_chunk_reserves_its_own_bytes_not_the_body_so_far() -> None:
    # a body exactly the size of the budget, in ten chunks, fits: each chunk takes its 100
    # bytes (ten times the body so far would take 5500)
    envoy = ScriptedEnvoy()
    for index in range(CHUNKS):
        data = bytes([index]) * CHUNK
        body = ep.HttpBody(body=data, end_of_stream=index == CHUNKS - 1)
        await envoy.inbox.put(ep.ProcessingRequest(request_body=body))
    budget = BodyBudget()
    reserved = budget.reservation()
    limits = UploadLimits(
        body_bytes=CHUNK * CHUNKS, budget_bytes=CHUNK * CHUNKS, idle_s=5.0, whole_s=5.0
    )
    upload = await gather_body(EnvoyStream(envoy), limits, reserved)  # type: ignore[arg-type]
    assert upload is not None
    assert upload.body == b"".join(bytes([i]) * CHUNK for i in range(CHUNKS))
    assert reserved.size == budget.in_use == CHUNK * CHUNKS
    reserved.release()
    assert budget.in_use == 0
