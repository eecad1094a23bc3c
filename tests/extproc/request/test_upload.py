"""A streamed upload gathered whole, its bytes taken from the process's body budget chunk by
chunk."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.request.body_budget import BodyBudget
from extproc.request.stream import EnvoyStream
from extproc.request.upload import UploadLimits, gather_body
from tests.support.scripted_envoy import ScriptedEnvoy

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
