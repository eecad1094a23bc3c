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


async def _served_model(session: aiohttp.ClientSession, address: str, timeout_s: float) -> str:
    async with session.get(
        f"http://{address}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as response:
        response.raise_for_status()
        return str((await response.json())["data"][0]["id"])


async def probe_prefill(rt: Runtime, session: aiohttp.ClientSession, address: str) -> bool:
    """Learn `address`'s identity with a one-token request; True if it was learned."""
    timeout_s = rt.config.timeouts.probe_s
    request_id = f"pd-extproc-probe-{uuid.uuid4()}"
    try:
        model = await _served_model(session, address, timeout_s)
        client_body = orjson.dumps({"model": model, "prompt": "probe", "temperature": 0})
        p_body = prefill_body(members(client_body), False, prefill_kv_params())
        result = await rt.prefill_client.send(
            address, "/v1/completions", p_body, request_id, timeout_s
        )
        identity = identity_from_params(result.kv_transfer_params)
    except (aiohttp.ClientError, TimeoutError, LegError, ValueError, KeyError, IndexError) as err:
        rt.metrics.probes.labels(address, "failed").inc()
        log.warning("identity probe of prefill %s failed: %s", address, err)
        return False
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
    try:
        async with session.post(
            f"http://{decode.address}/v1/completions",
            data=orjson.dumps(body),
            headers={"content-type": "application/json", "x-request-id": request_id},
            timeout=aiohttp.ClientTimeout(total=rt.config.timeouts.probe_s),
        ) as response:
            await response.read()
    except (aiohttp.ClientError, TimeoutError) as error:
        log.info("probe transfer to decode %s did not complete: %s", decode.address, error)
