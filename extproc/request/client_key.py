"""The client's key, checked by the ext_proc itself where the P leg does not carry it.

With `engines.api_key_file` set and `authorization` left out of `dispatch.forward_headers`, the
P leg carries the sidecar's key, not the client's: P would compute for any client, while D
(which Envoy hands the client's own `Authorization`) refuses one without a key. So before any
leg leaves, and before the body is read, the client's key is checked as vLLM's `--api-key`
checks it (`Bearer` in any case, then a token equal to one of the engines' keys, compared in
constant time) and a client without one gets a 401 here. Where the client's key is forwarded,
both engines check it themselves and refuse it before any work.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from extproc.config import Config
from extproc.errors import ClientError

__all__ = ["check_client_key", "client_key_checked_here"]


def client_key_checked_here(config: Config) -> bool:
    """Whether P never sees the client's key: the engines' keys are known and `authorization`
    is not forwarded (the P leg then carries the sidecar's key instead)."""
    return bool(config.engines.api_keys) and "authorization" not in config.dispatch.forward_headers


def check_client_key(headers: Mapping[str, str], config: Config) -> None:
    """Raise a 401 unless the client sent one of the engines' keys, where P would not check."""
    if client_key_checked_here(config) and not _accepted(headers.get("authorization"), config):
        raise ClientError(
            401, "Unauthorized: send one of the engines' API keys as Authorization: Bearer <key>"
        )


def _accepted(authorization: str | None, config: Config) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = _digest(token)  # hashed: the comparison's time says nothing of the keys' lengths
    return any([hmac.compare_digest(given, _digest(key)) for key in config.engines.api_keys])


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
