"""Proactive learning: find out a prefill engine's identity before user traffic needs it.

No peer router does this: they all learn from the first user request, which therefore runs
serially. The probe is a complete one-token P/D exchange (P through Envoy's prefill listener,
D directly), so P's blocks are released by a real transfer instead of expiring on a lease,
and the NIXL handshake between the two engines is already done when users arrive.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

import aiohttp
import orjson

from extproc.bodies import members, prefill_body, prefill_kv_params
from extproc.errors import LegError
from extproc.identity import identity_from_params

if TYPE_CHECKING:
    from extproc.runtime import Runtime

__all__ = ["probe_prefill"]

log = logging.getLogger("extproc.probe")


async def _served_model(
    session: aiohttp.ClientSession, address: str, timeout_s: float, headers: dict[str, str]
) -> str:
    async with session.get(
        f"http://{address}/v1/models",
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as response:
        response.raise_for_status()
        return str((await response.json())["data"][0]["id"])


def _status(error: Exception) -> int | None:
    if isinstance(error, aiohttp.ClientResponseError):
        return error.status
    return error.status if isinstance(error, LegError) else None


def _refused_key_message(rt: Runtime, address: str, status: int) -> str:
    if rt.config.engines.auth_headers:
        return (
            f"identity probe of prefill {address}: the engine refused the key of "
            f"engines.api_key_file ({status}); until a client request teaches it, the first "
            "requests to it run serially"
        )
    return (
        f"identity probe of prefill {address}: the engine requires an API key ({status}); set "
        "engines.api_key_file to the key the engines were started with (--api-key), or the "
        "first requests to it run serially until a client request teaches its identity"
    )


async def probe_prefill(
    rt: Runtime, session: aiohttp.ClientSession, address: str, refused: set[str]
) -> bool:
    """Learn `address`'s identity with a one-token request; True if it was learned.

    `refused` holds the endpoints already reported as refusing the probe's key (401/403):
    the probe repeats every health round, the warning is logged once.
    """
    timeout_s = rt.config.timeouts.probe_s
    request_id = f"pd-extproc-probe-{uuid.uuid4()}"
    auth = rt.config.engines.auth_headers
    try:
        model = await _served_model(session, address, timeout_s, auth)
        client_body = orjson.dumps({"model": model, "prompt": "probe", "temperature": 0})
        p_body = prefill_body(members(client_body), False, prefill_kv_params())
        result = await rt.prefill_client.send(
            address, "/v1/completions", p_body, request_id, timeout_s, auth
        )
        identity = identity_from_params(result.kv_transfer_params)
    except (aiohttp.ClientError, TimeoutError, LegError, ValueError, KeyError, IndexError) as err:
        rt.metrics.probes.labels(address, "failed").inc()
        status = _status(err)
        if status not in (401, 403):
            log.warning("identity probe of prefill %s failed: %s", address, err)
        elif address not in refused:
            refused.add(address)
            log.warning("%s", _refused_key_message(rt, address, status))
        return False
    refused.discard(address)
    rt.identities.learn(address, identity)
    rt.metrics.probes.labels(address, "learned").inc()
    log.info("prefill %s: engine %s (%s)", address, identity.engine_id, identity.transfer_mode)
    await _complete_transfer(
        rt, session, client_body, result.kv_transfer_params, request_id,
        rt.group_of("prefill", address).members["decode"],
    )  # fmt: skip
    return True


async def _complete_transfer(
    rt: Runtime,
    session: aiohttp.ClientSession,
    client_body: bytes,
    params: object,
    request_id: str,
    decodes: set[str],
) -> None:
    """Let a decode engine of the same model take the probe's KV, so P frees its blocks."""
    decode = rt.decode.pick(among=decodes)
    if decode is None:
        return  # P's lease frees the blocks later
    body = orjson.loads(client_body) | {"max_tokens": 1, "kv_transfer_params": params}
    headers = {"content-type": "application/json", "x-request-id": request_id}
    try:
        async with session.post(
            f"http://{decode.address}/v1/completions",
            data=orjson.dumps(body),
            headers=headers | rt.config.engines.auth_headers,
            timeout=aiohttp.ClientTimeout(total=rt.config.timeouts.probe_s),
        ) as response:
            await response.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        log.info("probe transfer to decode %s did not complete: %s", decode.address, error)
