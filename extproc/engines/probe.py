"""Proactive learning: find out a prefill engine's identity before user traffic needs it.

No peer router does this: they all learn from the first user request, which therefore runs
serially. The probe is a complete one-token P/D exchange (P through Envoy's prefill listener,
D directly), so P's blocks are released by a real transfer instead of expiring on a lease,
and the NIXL handshake between the two engines is already done when users arrive. An engine
with data-parallel ranks is probed once per rank whose identity is missing, each pinned with
vLLM's rank header.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import aiohttp
import orjson

from extproc.engines.health_reasons import failure_reason
from extproc.engines.kv_compat import KvCompatibility, Mismatch
from extproc.errors import LegError
from extproc.headers import RANK_HEADER
from extproc.protocol.bodies import members, prefill_body, prefill_kv_params
from extproc.protocol.identity import PrefillIdentity, identity_from_params, ranks_of, where
from extproc.request.prefill_client import PrefillCall

if TYPE_CHECKING:
    from extproc.config import Config
    from extproc.metrics import Metrics
    from extproc.request.prefill_client import PrefillSender
    from extproc.scheduling.pool import EndpointState

__all__ = ["Prober"]

log = logging.getLogger("extproc.engines.probe")


async def _served_model(
    session: aiohttp.ClientSession, address: str, timeout_s: float, headers: dict[str, str]
) -> tuple[str, int | None, list[str]]:
    """The model the engine serves, its context length if it says (vLLM's `max_model_len`),
    and every name of its base model: vLLM lists each served name, and each LoRA adapter
    with its base as `parent`."""
    async with session.get(
        f"http://{address}/v1/models",
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as response:
        response.raise_for_status()
        listed = (await response.json())["data"]
        served = listed[0]
        length = served.get("max_model_len")
        known = type(length) is int and length > 0
        bases = [
            str(card["id"])
            for card in listed
            if isinstance(card, dict) and card.get("parent") is None and "id" in card
        ]
        return str(served["id"]), length if known else None, bases


def _status(error: Exception) -> int | None:
    if isinstance(error, aiohttp.ClientResponseError):
        return error.status
    return error.status if isinstance(error, LegError) else None


def _refused_key_message(auth_headers: dict[str, str], address: str, status: int) -> str:
    if auth_headers:
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


class Learner(Protocol):
    """What the probe needs of the identity cache."""

    def learn(self, endpoint: str, identity: PrefillIdentity, rank: int | None = None) -> None: ...
    def missing(self, endpoint: str, data_parallel_size: int = 1) -> list[int | None]: ...


class DecodePicker(Protocol):
    """What the probe needs of the decode pool: one healthy member of a model's set."""

    def pick(self, *, among: set[str]) -> EndpointState | None: ...


class Prober:
    """Learns prefill identities with one-token requests; called by the health checker."""

    def __init__(
        self,
        prefill_client: PrefillSender,
        identities: Learner,
        decode: DecodePicker,
        decodes_of: Callable[[str], set[str]],  # prefill address → its model's decode members
        metrics: Metrics,
        config: Callable[[], Config],  # the current config: a reload swaps it
        on_served: Callable[[str], None] = lambda model: None,  # a model an engine serves
        compat: KvCompatibility | None = None,  # where a pair that cannot exchange KV goes
        ranks_of: Callable[[str], int] = lambda address: 1,  # its data-parallel ranks
        on_context: Callable[[str, int], None] = lambda address, tokens: None,  # its length
        on_bases: Callable[[str, list[str]], None] = lambda address, names: None,  # base's names
    ) -> None:
        self._on_bases = on_bases
        self._on_context = on_context
        self._ranks_of = ranks_of
        self._compat = compat or KvCompatibility()
        self._on_served = on_served
        self._prefill_client = prefill_client
        self._identities = identities
        self._decode = decode
        self._decodes_of = decodes_of
        self._metrics = metrics
        self._config = config

    async def probe(self, session: aiohttp.ClientSession, address: str, refused: set[str]) -> bool:
        """Learn `address`'s identity (each missing rank's; all of them when none is missing:
        a probe asked again) with one-token requests; True if every one was learned.

        `refused` holds the endpoints already reported as refusing the probe's key (401/403):
        the probe repeats every health round, the warning is logged once.
        """
        size = self._ranks_of(address)
        ranks = self._identities.missing(address, size) or ranks_of(size)
        learned = [await self._probe_rank(session, address, refused, rank) for rank in ranks]
        return all(learned)

    async def _probe_rank(
        self, session: aiohttp.ClientSession, address: str, refused: set[str], rank: int | None
    ) -> bool:
        config = self._config()
        timeout_s = config.timeouts.probe_s
        request_id = f"pd-extproc-probe-{uuid.uuid4()}"
        auth = config.engines.auth_headers
        try:
            model, context, bases = await _served_model(session, address, timeout_s, auth)
            self._on_served(model)
            self._on_bases(address, bases)
            if context is not None:
                self._on_context(address, context)
            client_body = orjson.dumps({"model": model, "prompt": "probe", "temperature": 0})
            p_body = prefill_body(members(client_body), False, prefill_kv_params())
            pinned = auth if rank is None else auth | {RANK_HEADER: str(rank)}
            call = PrefillCall(
                address, "/v1/completions", p_body, request_id, timeout_s, config, pinned
            )
            result = await self._prefill_client.send(call)
            identity = identity_from_params(result.kv_transfer_params)
        except (
            aiohttp.ClientError,
            TimeoutError,
            LegError,
            ValueError,
            KeyError,
            IndexError,
        ) as err:
            self._metrics.probes.labels(address, "failed").inc()
            status = _status(err)
            if status not in (401, 403):
                log.warning("identity probe of prefill %s failed: %s", address, failure_reason(err))
            elif address not in refused:
                refused.add(address)
                log.warning("%s", _refused_key_message(auth, address, status))
            return False
        refused.discard(address)
        self._identities.learn(address, identity, rank)
        log.info(
            "prefill %s: engine %s (%s)",
            where(address, rank),
            identity.engine_id,
            identity.transfer_mode,
        )
        failure = await self._complete_transfer(
            session, client_body, result.kv_transfer_params, request_id, address, identity
        )
        if failure is not None:  # P is fine (its identity is kept); the exchange is not
            self._metrics.probes.labels(address, "failed").inc()
            said, repeated = failure
            log.log(
                logging.DEBUG if repeated else logging.WARNING,
                "identity probe of prefill %s failed: %s",
                address,
                said,
            )
            return False
        self._metrics.probes.labels(address, "learned").inc()
        return True

    async def _complete_transfer(
        self,
        session: aiohttp.ClientSession,
        client_body: bytes,
        params: object,
        request_id: str,
        prefill: str,
        identity: PrefillIdentity,
    ) -> tuple[str, bool] | None:
        """Let a decode engine of the same model take the probe's KV, as a request would, so
        P frees its blocks and a pair that cannot exchange KV is found. None if it did; else
        why not, and whether that is a mismatch already reported."""
        decode = self._decode.pick(among=self._decodes_of(prefill))
        if decode is None:
            return None  # P's lease frees the blocks later
        config = self._config()
        body = orjson.loads(client_body) | {"max_tokens": 1, "kv_transfer_params": params}
        headers = {"content-type": "application/json", "x-request-id": request_id}
        try:
            async with session.post(
                f"http://{decode.address}/v1/completions",
                data=orjson.dumps(body),
                headers=headers | config.engines.auth_headers,
                timeout=aiohttp.ClientTimeout(total=config.timeouts.probe_s),
            ) as response:
                answer = await response.content.read(_ANSWER_BYTES)
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            reason = failure_reason(error)
            return f"its decode leg to {decode.address} did not complete: {reason}", False
        if status < 400:
            self._compat.passed(prefill, decode.address)
            return None
        said = f"HTTP {status}: {_error_message(answer)}"
        repeated = False
        if status >= 500 and status != 503:  # D took the request and failed on P's KV
            mismatch = Mismatch(prefill, decode.address, identity.transfer_mode, said)
            repeated = not self._compat.failed(mismatch)
        return f"its decode leg to {decode.address} answered {said}", repeated


_ANSWER_BYTES = 4096  # of D's error body: enough for its message


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else its first line (bounded)."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body.decode(errors="replace").partition("\n")[0]
    return str(message)[:200]
