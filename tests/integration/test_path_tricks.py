"""Path tricks through the real Envoy, ext_proc and vllmsim: a request target that dodges the
LLM routes (dot segments, encoded slashes, backslashes, ...) must never carry the client's own
body, with its `kv_transfer_params`, to an engine past the ext_proc.

Each trick is sent byte for byte on a raw HTTP/1.1 connection (an HTTP client library would
normalise or encode some of them). The client must get a JSON error whose `code` is the HTTP
status, or an answer the ext_proc processed; every engine's request log (GET /sim/requests,
which also records requests no route of the engine matched) must be free of the client's
`kv_transfer_params` and of any copy of the client's body that skipped the ext_proc.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import orjson
import pytest_asyncio

from tests.support.engines import MODEL
from tests.support.topology import Topology, topology
from vllmsim.launcher import FAST

# kind → request targets. Each one aims, one way or another, at a completion path through a
# route that has no ext_proc (the pass-through routes /health, /v1/models, ...).
TRICKS: dict[str, list[str]] = {
    "dot segments": [
        "/health/../v1/completions",
        "/v1/models/../completions",
        "/tokenize/../v1/chat/completions",
    ],
    "encoded dots": ["/v1/models/%2e%2e/completions", "/health/%2E%2E/v1/completions"],
    "encoded slash": [
        "/v1/models%2F..%2Fcompletions",
        "/v1/models%2f..%2fcompletions",
        "/health/..%2Fv1/completions",
    ],
    "backslash": ["/v1/models\\..\\completions", "/health\\..\\v1\\completions"],
    "encoded backslash": ["/v1/models%5C..%5Ccompletions", "/health%5c..%5cv1/completions"],
    "double slashes": [
        "//health/..//v1/completions",
        "/v1/models//..//completions",
        "//v1//models",
    ],
    "trailing dots": ["/v1/models/.", "/health/.", "/metrics/./"],
    "mixed case": ["/V1/Models/../completions", "/HEALTH/../v1/completions", "/V1/MODELS"],
    "query string": ["/v1/models?/../completions", "/health?x=/../v1/completions"],
    "fragment": ["/health#/../v1/completions", "/v1/models#x"],
    ";params": ["/health;x=1/../v1/completions", "/v1/models;/../completions"],
    "prefix extension": ["/healthz", "/v1/modelsX/../completions", "/metrics-extra"],
    "encoded letters": ["/v1/%6dodels/../completions", "/%68ealth/../v1/completions"],
    "nul byte": ["/health%00/../v1/completions"],
    "absolute form": [
        "http://pd.test/health/../v1/completions",
        "http://pd.test/v1/models%2F..%2Fcompletions",
    ],
    "exact pass-through path": ["/v1/models", "/health", "/version"],
}


@pytest_asyncio.fixture(scope="module")
async def topo() -> AsyncIterator[Topology]:
    async with topology(engine_flags=FAST) as topo:
        yield topo


async def raw_request(url: str, target: str, body: bytes, request_id: str) -> tuple[int, bytes]:
    """POST `target` exactly as written on a fresh HTTP/1.1 connection → (status, body)."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        head = (
            f"POST {target} HTTP/1.1\r\nhost: pd.test\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-request-id: {request_id}\r\n"
            "connection: close\r\n\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 20)  # until Envoy closes
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in headers.lower():
        payload = _unchunk(payload)
    return int(status_line.split()[1]), payload


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


def answer_problem(status: int, payload: bytes) -> str | None:
    """None for a JSON error whose code is the status or a completion the ext_proc processed."""
    try:
        doc = orjson.loads(payload)
        if status == 200 and doc["object"] in {"text_completion", "chat.completion"}:
            return None
        if 400 <= status < 600 and doc["error"]["code"] == status and doc["error"]["message"]:
            return None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        pass
    return f"{status} {payload[:120]!r}"


def client_body(marker: str, index: int) -> bytes:
    """A body for either API, with kv_transfer_params only this client could have written."""
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": f"{marker}-{index}",
        "remote_host": "10.9.9.9",
        "remote_port": 5600,
    }
    return orjson.dumps(
        {
            "model": MODEL,
            "prompt": f"{marker} says hello",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": marker}],
            "kv_transfer_params": params,
        }
    )


async def test_no_path_trick_carries_the_clients_body_to_an_engine(topo: Topology) -> None:
    await topo.clear()
    marker = f"client-{uuid.uuid4()}"
    targets = [(kind, target) for kind, listed in TRICKS.items() for target in listed]
    answers: dict[str, list[str]] = {}
    for index, (kind, target) in enumerate(targets):
        body = client_body(marker, index)
        status, payload = await raw_request(topo.sidecar.url, target, body, f"{marker}-{index}")
        if (problem := answer_problem(status, payload)) is not None:
            answers.setdefault(kind, []).append(f"{target}: answered {problem}")
    # The ext_proc replaces kv_transfer_params on every leg it sends: an engine that got this
    # client's value got a body that skipped the ext_proc.
    leak = re.compile(f'"remote_engine_id":"{marker}-(\\d+)"')
    leaks: dict[str, list[str]] = {}
    for engine in topo.engines:
        for record in await topo.seen(engine):
            if (found := leak.search(_text(record["body"]))) is not None:
                kind, target = targets[int(found.group(1))]
                leaks.setdefault(kind, []).append(
                    f"{target}: reached an engine as {record.get('method', 'POST')} "
                    f"{record['path']} ({record['outcome']})"
                )
    assert not leaks, f"{len(leaks)} of {len(TRICKS)} kinds reached an engine:\n{_lines(leaks)}"
    assert not answers, f"{len(answers)} of {len(TRICKS)} kinds got no clear answer:\n" + _lines(
        answers
    )


def _lines(found: dict[str, list[str]]) -> str:
    return "\n".join(f"{kind}: {line}" for kind, lines in found.items() for line in lines)


def _text(body: object) -> str:
    return body if isinstance(body, str) else orjson.dumps(body).decode()


async def test_pass_through_routes_still_reach_the_engines(topo: Topology) -> None:
    url = topo.sidecar.url
    for path in ("/v1/models", "/health", "/version"):
        async with topo.session.get(url + path) as response:
            assert response.status == 200, path
    async with topo.session.post(url + "/tokenize", json={"model": MODEL, "prompt": "hi"}) as r:
        assert r.status == 200 and (await r.json())["count"] > 0
    async with topo.session.get(url + "/v1/models?x=1") as response:  # the query is no trick
        assert (await response.json())["data"][0]["id"] == MODEL


async def test_an_engines_metrics_are_not_served_on_the_client_port(topo: Topology) -> None:
    """A client scraping the ingress would read a random decode engine's numbers each time
    (and learn the deployment's internals): GET /metrics gets a JSON 404 instead."""
    for target in ("/metrics", "/metrics?name[]=vllm:num_requests_running"):
        async with topo.session.get(topo.sidecar.url + target) as response:
            body = await response.read()
            assert response.status == 404, (target, body[:200])
            assert orjson.loads(body)["error"]["code"] == 404
            assert b"vllm:" not in body


async def test_a_passed_through_request_carries_no_routing_header_of_the_client(
    topo: Topology,
) -> None:
    """The pass-through routes skip the ext_proc, but Envoy removes the client's copies of the
    headers the sidecar owns (destination, data-parallel rank in any case, local-reply flags)."""
    await topo.clear()
    owned = {
        "X-Data-Parallel-Rank": "1",
        "x-pd-extproc-envoy-flags": "UF",
        "X-Gateway-Destination-Endpoint": "10.9.9.9:1",
    }
    async with topo.session.post(
        topo.sidecar.url + "/tokenize",
        json={"model": MODEL, "prompt": "hi"},
        headers=owned | {"x-kept": "1"},
    ) as response:
        assert response.status == 200, await response.text()
    [record] = [r for e in topo.engines for r in await topo.seen(e)]
    assert record["path"] == "/tokenize" and record["headers"]["x-kept"] == "1"
    assert not {name.lower() for name in owned} & set(record["headers"]), record["headers"]
