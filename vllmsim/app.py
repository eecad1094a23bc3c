"""Builds the aiohttp Application: API routes plus /sim/* admin routes."""

from __future__ import annotations

from aiohttp import web

from vllmsim.faults import add_admin_routes
from vllmsim.http_api import add_routes, record_unrouted
from vllmsim.server import SIM_KEY, SimServer


def build_app(sim: SimServer) -> web.Application:
    app = web.Application(
        client_max_size=64 * 1024 * 1024, middlewares=[record_unrouted]
    )
    app[SIM_KEY] = sim
    add_routes(app)
    add_admin_routes(app)
    return app
