"""aiohttp routes of the OpenAI-compatible API, driving the engine of the current generation.

Every completion request leaves one record in `SimServer.records` (see GET /sim/requests), and
so does every request no route matched (outcome "unrouted"): a proxy in front must never let a
request through to a path it did not mean to, and tests see such a request here. So do the
bodies a proxy passes through untouched (POST /tokenize and /detokenize): tests see what
reached the engine past the ext_proc.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from vllmsim import shapes
from vllmsim.engine import ErrorEvent, Event, FinishEvent, SimRequest, TokenEvent
from vllmsim.faults import apply_request_faults
from vllmsim.metrics import FETCH_STAGES
from vllmsim.metrics import render as render_metrics
from vllmsim.requests import (
    ApiError,
    ParsedRequest,
    base_request_id,
    invalid_json,
    parse,
    prompt_ids,
)
from vllmsim.server import SIM_KEY, Rank, SimServer

log = logging.getLogger(__name__)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=shapes.dumps(obj), status=status, content_type="application/json")


def error_response(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> web.Response:
    return json_response(shapes.error_body(message, status, param, kind), status)


def _headers(request: web.Request) -> dict[str, str]:
    """The request's headers, lowercase; a repeated one as its values joined with ", " (so a
    test sees every copy an engine got)."""
    return {k.lower(): ", ".join(request.headers.getall(k)) for k in request.headers}


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    sim = request.app[SIM_KEY]
    rec: dict[str, Any] = {
        "x_request_id": request.headers.get("X-Request-Id"),
        "internal_id": None,
        "path": request.path,
        "received_at": time.time(),
        "body": None,
        "headers": _headers(request),
        "status": None,
        "outcome": "running",
        "kv": None,
        "kv_evidence": None,
        "first_token_at": None,
        "body_bytes": None,
        "events": [],
        "data_parallel_rank": None,  # the engine rank that served it
        "engine_id": None,  # that rank's engine id when it was submitted
    }
    sim.records.append(rec)
    try:
        response = await _serve(request, sim, rec, chat)
    except asyncio.CancelledError:
        rec["outcome"] = "aborted"
        raise
    if rec["outcome"] == "running":
        rec["outcome"] = "ok" if response.status < 400 else "error"
    rec["status"] = response.status
    return response


async def _serve(
    request: web.Request, sim: SimServer, rec: dict[str, Any], chat: bool
) -> web.StreamResponse:
    raw = await request.read()
    rec["body_bytes"] = len(raw)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        error = invalid_json(raw)
        return error_response(error.status, error.message, error.param, error.kind)
    rec["body"] = body
    if (fault := await apply_request_faults(sim.faults)) is not None:
        return error_response(fault, "Simulated failure (vllmsim fault injection)")
    try:
        parsed = parse(sim.cfg, sim.tokens, body, chat)
    except ApiError as exc:
        if exc.in_stream and isinstance(body, dict) and body.get("stream") is True:
            return await _stream_error(request, exc, rec)
        return error_response(exc.status, exc.message, exc.param, exc.kind)
    try:
        rank = choose_rank(sim, request.headers.get(RANK_HEADER))
    except ApiError as exc:
        return error_response(exc.status, exc.message, exc.param, exc.kind)
    external, internal = shapes.request_ids(base_request_id(request.headers, body), chat)
    rec["internal_id"] = internal
    rank.in_flight += 1
    try:
        return await _run(request, sim, rank, parsed, rec, (external, internal))
    finally:
        rank.in_flight -= 1


RANK_HEADER = "X-data-parallel-rank"


def session_id(headers: Any, body: dict[str, Any]) -> str | None:
    """The request's session as vLLM 0.32 reads it: the body's `session_id`, else the
    X-Session-ID header, else `vllm_xargs.session_id`."""
    xargs = body.get("vllm_xargs")
    for value in (
        body.get("session_id"),
        headers.get("X-Session-ID"),
        xargs.get("session_id") if isinstance(xargs, dict) else None,
    ):
        if isinstance(value, str) and value:
            return value
    return None


def choose_rank(sim: SimServer, header: str | None) -> Rank:
    """The rank a request goes to, as vLLM: the header's (an integer; anything else counts as
    no header), else the load balancer's; a rank out of range is the client's error (400)."""
    rank: int | None = None
    if header is not None:
        try:
            rank = int(header)
        except ValueError:
            rank = None
    if rank is None:
        return sim.balance()
    if not 0 <= rank < len(sim.ranks):
        raise ApiError(400, f"data_parallel_rank {rank} is out of range [0, {len(sim.ranks)}).")
    return sim.ranks[rank]


async def _run(
    request: web.Request,
    sim: SimServer,
    rank: Rank,
    parsed: ParsedRequest,
    rec: dict[str, Any],
    ids: tuple[str, str],
) -> web.StreamResponse:
    external, internal = ids
    req = SimRequest(
        internal,
        parsed.prompt_ids,
        parsed.max_tokens,
        mode=parsed.mode,
        remote=parsed.kv_params,
        session_id=session_id(request.headers, rec["body"]),
        scope=parsed.scope,
    )
    rec["events"] = req.timeline  # the same list: P's push events arrive after its answer
    await rank.current.engine.api_path(len(parsed.prompt_ids))
    # Read after the waits above: a restart meanwhile ended the engine of the generation
    # before, whose loop no longer steps (a request handed to it would never be answered).
    gen = rank.current
    rec["data_parallel_rank"], rec["engine_id"] = rank.index, gen.engine_id
    engine = gen.engine
    engine.submit(req)
    try:
        if parsed.stream:
            return await _stream(request, req, parsed, external, rec)
        return await _complete(request, req, parsed, external, rec)
    finally:
        engine.abort(req)  # no-op once finished; frees blocks on disconnect
        rec["kv"], rec["kv_evidence"] = req.kv_label, req.kv_evidence


async def _events(req: SimRequest, rec: dict[str, Any]) -> AsyncIterator[Event]:
    while True:
        event = await req.events.get()
        if isinstance(event, TokenEvent) and event.index == 0:
            rec["first_token_at"] = time.time()
        yield event
        if not isinstance(event, TokenEvent):
            return


def _cached(request: web.Request, req: SimRequest) -> int | None:
    """usage.prompt_tokens_details.cached_tokens (with --enable-prompt-tokens-details): the
    prompt tokens not computed here, from the prefix cache or a transfer, as vLLM counts."""
    if not request.app[SIM_KEY].cfg.enable_prompt_tokens_details:
        return None
    return req.num_cached_tokens + req.num_external_tokens


def _reset(request: web.Request, rec: dict[str, Any]) -> None:
    """A simulated restart: the peer sees its connection reset, like a dead process."""
    rec["outcome"] = "aborted"
    if request.transport is not None:
        request.transport.abort()
    raise asyncio.CancelledError


async def _complete(
    request: web.Request, req: SimRequest, parsed: ParsedRequest, external: str, rec: dict[str, Any]
) -> web.StreamResponse:
    created, text = int(time.time()), []
    async for event in _events(req, rec):
        if isinstance(event, TokenEvent):
            text.append(event.text)
        elif isinstance(event, ErrorEvent):
            if event.reset:
                _reset(request, rec)
            return error_response(event.status, event.message)
        else:
            build = shapes.chat_completion if parsed.chat else shapes.completion
            return json_response(
                build(
                    external,
                    created,
                    parsed.model,
                    "".join(text),
                    event.finish_reason,
                    parsed.prompt_tokens,
                    len(text),
                    event.kv_transfer_params,
                    _cached(request, req),
                )
            )
    raise RuntimeError("event stream ended without a finish")


async def _stream(
    request: web.Request, req: SimRequest, parsed: ParsedRequest, external: str, rec: dict[str, Any]
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": shapes.SSE_CONTENT_TYPE})
    await resp.prepare(request)
    created, model, last, n = int(time.time()), parsed.model, None, 0
    async for event in _events(req, rec):
        if isinstance(event, ErrorEvent):
            if event.reset:
                _reset(request, rec)
            rec["outcome"] = "error"
            await resp.write(shapes.sse_error(event.message, event.status))
            break
        if isinstance(event, TokenEvent):
            if n == 0 and parsed.chat:
                await resp.write(shapes.sse(shapes.chat_role_chunk(external, created, model)))
            n += 1
            if event.final:  # its chunk carries the finish, which the same batch delivers
                last = event
            else:  # as vLLM: each token leaves as soon as its step produced it
                await resp.write(_chunk(parsed, external, created, event.text, None))
            continue
        assert isinstance(event, FinishEvent) and last is not None
        await resp.write(_chunk(parsed, external, created, last.text, event))
        if parsed.include_usage:
            make = shapes.chat_usage_chunk if parsed.chat else shapes.completion_usage_chunk
            await resp.write(
                shapes.sse(
                    make(external, created, model, parsed.prompt_tokens, n, _cached(request, req))
                )
            )
    await resp.write(shapes.DONE)
    await resp.write_eof()
    return resp


async def _stream_error(
    request: web.Request, exc: ApiError, rec: dict[str, Any]
) -> web.StreamResponse:
    """A stream that fails before its first token: 200, the error event, [DONE]."""
    rec["outcome"] = "error"
    resp = web.StreamResponse(headers={"Content-Type": shapes.SSE_CONTENT_TYPE})
    await resp.prepare(request)
    await resp.write(shapes.sse_error(exc.message, exc.status))
    await resp.write(shapes.DONE)
    await resp.write_eof()
    return resp


def _chunk(
    parsed: ParsedRequest, rid: str, created: int, text: str, finish: FinishEvent | None
) -> bytes:
    reason = finish.finish_reason if finish else None
    params = finish.kv_transfer_params if finish else None
    last = finish is not None and not parsed.include_usage  # no usage chunk follows
    if parsed.chat:
        return shapes.sse(
            shapes.chat_chunk(
                rid,
                created,
                parsed.model,
                {"content": text},
                reason,
                final=finish is not None,
                kv_params=params,
                last=last,
            )
        )
    return shapes.sse(
        shapes.completion_chunk(rid, created, parsed.model, text, reason, params, last=last)
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def record_unrouted(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Record a request no route matched (404/405) with its raw path and body, then refuse it."""
    refusal = request.match_info.http_exception
    if refusal is None or request.method == "OPTIONS":  # vLLM's CORS layer answers preflights
        return await handler(request)
    _record_bare(request, await request.read(), request.raw_path, refusal.status, "unrouted")
    raise refusal


# -- small endpoints ---------------------------------------------------------------------------
async def models(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    created = int(sim.current.start_time)
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": sim.cfg.cost.max_model_len,
        }
        for name in sim.cfg.served_model_names
    ]
    data += [  # as vLLM lists its LoRA adapters: after the base model, which is their parent
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": name,
            "parent": sim.cfg.served_model_names[0],
            "max_model_len": sim.cfg.cost.max_model_len,
        }
        for name in sim.cfg.lora_modules
    ]
    return json_response({"object": "list", "data": data})


async def health(_request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(_request: web.Request) -> web.Response:
    return json_response({"version": "0.33.0"})


async def metrics(request: web.Request) -> web.Response:
    ranks = request.app[SIM_KEY].ranks
    for rank in ranks:
        _update_gauges(rank)
    body = render_metrics(rank.current.metrics for rank in ranks)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def _update_gauges(rank: Rank) -> None:
    gen = rank.current
    m, engine = gen.metrics, gen.engine
    m.lbl(m.running).set(len(engine.running))
    m.lbl(m.waiting).set(engine.num_waiting)
    m.lbl(m.waiting_by_reason, reason="capacity").set(len(engine.waiting))
    m.lbl(m.waiting_by_reason, reason="deferred").set(len(engine.remote_wait))
    m.lbl(m.kv_usage).set(engine.pool.usage())
    stages = dict.fromkeys(FETCH_STAGES, 0)
    for req in [*engine.waiting, *engine.remote_wait, *engine.running]:
        if req.fetch_stage in stages:
            stages[req.fetch_stage] += 1
    for stage, count in stages.items():
        m.lbl(m.fetch_by_stage, stage=stage).set(count)


@web.middleware
async def record_passed_through(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Record a request to an endpoint that computes nothing (/tokenize, /detokenize) with
    its headers and body, as it reached the engine."""
    if request.path not in _PASSED_THROUGH or request.method != "POST":
        return await handler(request)
    raw = await request.read()
    response = await handler(request)
    _record_bare(request, raw, request.path, response.status, "passed_through")
    return response


_PASSED_THROUGH = ("/tokenize", "/detokenize")


async def tokenize(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    body = await request.json()
    if "messages" in body:
        try:
            ids = prompt_ids(body, True, sim.tokens)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.kind)
    elif isinstance(body.get("prompt"), str):
        ids = sim.tokens.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
    else:
        return error_response(400, "prompt or messages is required")
    return json_response(
        {
            "count": len(ids),
            "max_model_len": sim.cfg.cost.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    body = await request.json()
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        return error_response(400, "tokens must be a list of integers")
    return json_response({"prompt": sim.tokens.decode(ids)})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's development route: every rank forgets its cached prefixes (a rank with a block in
    use keeps them and says so in the log, as vLLM does), 200 either way."""
    for rank in request.app[SIM_KEY].ranks:
        if not rank.current.engine.reset_prefix_cache():
            log.warning("rank %d: prefix cache not reset, some blocks are in use", rank.index)
    return web.Response(status=200)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    if app[SIM_KEY].cfg.dev_mode:
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)


def _record_bare(request: web.Request, raw: bytes, path: str, status: int, outcome: str) -> None:
    """Record a request that no engine step served, with its headers and body as it came."""
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = raw.decode(errors="replace")
    request.app[SIM_KEY].records.append(
        {
            "x_request_id": request.headers.get("X-Request-Id"),
            "internal_id": None,
            "method": request.method,
            "path": path,
            "received_at": time.time(),
            "body": body,
            "headers": _headers(request),
            "status": status,
            "outcome": outcome,
            "kv": None,
            "kv_evidence": None,
            "first_token_at": None,
            "body_bytes": len(raw),
        }
    )
