"""Builds the aiohttp Application: API routes plus /sim/* admin routes."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from vllmsim.auth import auth_middleware
from vllmsim.faults import add_admin_routes
from vllmsim.http_api import add_routes, record_passed_through, record_unrouted
from vllmsim.server import SIM_KEY, SimServer


def build_app(sim: SimServer) -> web.Application:
    middlewares: list[Middleware] = [record_unrouted]
    if sim.cfg.api_keys:
        middlewares.append(auth_middleware(sim.cfg.api_keys))
    middlewares.append(record_passed_through)  # after the key check: what the API served
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
    app[SIM_KEY] = sim
    add_routes(app)
    add_admin_routes(app)
    return app
