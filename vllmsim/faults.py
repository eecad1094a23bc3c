"""Fault injection (fail N, hang N, latency, drop registrations, refuse connections,
broken KV transfers, restart) and the /sim/* admin routes that flip it at run time."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from vllmsim.config import Faults
from vllmsim.server import SIM_KEY


async def apply_request_faults(faults: Faults) -> int | None:
    """Run the per-request faults; returns an HTTP status to fail with, or None."""
    if faults.latency_ms > 0:
        await asyncio.sleep(faults.latency_ms / 1000.0)
    if faults.hang_next > 0:
        faults.hang_next -= 1
        await asyncio.Event().wait()  # never set: only a client disconnect ends this
    if faults.fail_next > 0:
        faults.fail_next -= 1
        return faults.fail_status
    return None


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="expected a JSON object")
    return body


async def get_faults(request: web.Request) -> web.Response:
    return _json(request.app[SIM_KEY].faults.as_dict())


async def post_faults(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    body = await _body(request)
    faults = sim.faults
    if "fail_next" in body:  # fail_status defaults to 500 for each new fail_next
        faults.fail_next = int(body["fail_next"])
        faults.fail_status = int(body.get("fail_status", 500))
    elif "fail_status" in body:
        faults.fail_status = int(body["fail_status"])
    if "hang_next" in body:
        faults.hang_next = int(body["hang_next"])
    if "latency_ms" in body:
        faults.latency_ms = float(body["latency_ms"])
    if "drop_registrations" in body:
        faults.drop_registrations = bool(body["drop_registrations"])
    for key in ("kv_block_offset", "kv_truncate_blocks"):
        if key in body:
            setattr(faults, key, int(body[key]))
    if "refuse_connections" in body:
        await sim.set_refuse(bool(body["refuse_connections"]), body.get("refuse_for_s"))
    return _json(faults.as_dict())


async def delete_faults(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    fresh = Faults()
    for key, value in fresh.as_dict().items():
        if key != "refuse_connections":
            setattr(sim.faults, key, value)
    await sim.set_refuse(False)
    return _json(sim.faults.as_dict())


async def restart(request: web.Request) -> web.Response:
    sim = request.app[SIM_KEY]
    body = await _body(request)
    rank = body.get("rank")
    if rank is not None and (
        not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < len(sim.ranks)
    ):
        raise web.HTTPBadRequest(text=f"rank must be an integer in [0, {len(sim.ranks)})")
    await sim.restart(float(body.get("down_for_s", 0.0)), rank)
    return _json(sim.state())


async def state(request: web.Request) -> web.Response:
    return _json(request.app[SIM_KEY].state())


async def get_requests(request: web.Request) -> web.Response:
    return _json(request.app[SIM_KEY].records)


async def delete_requests(request: web.Request) -> web.Response:
    request.app[SIM_KEY].records.clear()
    return _json([])


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/sim/state", state)
    app.router.add_get("/sim/requests", get_requests)
    app.router.add_delete("/sim/requests", delete_requests)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", post_faults)
    app.router.add_delete("/sim/faults", delete_faults)
    app.router.add_post("/sim/restart", restart)
