"""`--api-key`: the bearer-token check vLLM's OpenAI server applies when started with a key.

Like vLLM: every route needs `Authorization: Bearer <one of the keys>` except the public ones
(health, version, metrics and the other probes an orchestrator makes without credentials) and
CORS preflights; a refused request gets 401 with vLLM's body `{"error": "Unauthorized"}`. The
scheme is matched without regard to case and keys are compared in constant time. The
simulator's own /sim/* admin routes are not part of vLLM and stay open for tests.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = ["auth_middleware"]

PUBLIC_PATHS = ("/health", "/ping", "/load", "/version", "/metrics", "/sim")
UNAUTHORIZED = b'{"error":"Unauthorized"}'

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _public(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS)


def _digest(key: str) -> bytes:
    # Hashing first makes the comparison's time independent of the key's length as well.
    return hashlib.sha256(key.encode()).digest()


def auth_middleware(
    keys: Sequence[str],
) -> Middleware:
    """An aiohttp middleware that lets through requests carrying one of `keys`."""
    digests = [_digest(k) for k in keys]

    def authorised(header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = _digest(token)
        return any([hmac.compare_digest(given, d) for d in digests])  # no early exit

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or _public(request.path):
            return await handler(request)
        if not authorised(request.headers.get("Authorization")):
            return web.Response(status=401, body=UNAUTHORIZED, content_type="application/json")
        return await handler(request)

    return check
