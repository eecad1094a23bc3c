"""The P leg straight to the engine, for where no prefill listener exists (an endpoint
picker behind someone else's gateway) or where its latency and CPU matter more.

The same interface as `PrefillClient`. What it gives up against the listener: Envoy's
connection pooling and retries, its per-cluster stats, and override_host's check that the
endpoint is a member of prefill_pool (the ext_proc's own pool is the only check here).
Connections are kept alive per engine; the keep-alive is shorter than the engines' own (vLLM
closes idle connections after 5 s), so that a request never goes out on a connection the
engine is closing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp

from extproc.errors import PrefillTimeout, PrefillUnreachable
from extproc.request.prefill_leg import PrefillResult, prefill_result

__all__ = ["DirectPrefillClient"]

_KEEPALIVE_S = 4.0  # below vLLM's (uvicorn's) 5 s idle close


class DirectPrefillClient:
    """Sends P legs to the prefill engine itself ("host:port"), one connection pool per engine.

    `auth_headers` gives the engines' key (engines.api_key_file) where the wiring wants it
    sent; a client key forwarded by dispatch.forward_headers wins over it.
    """

    def __init__(
        self, connect_timeout_s: float, auth_headers: Callable[[], dict[str, str]]
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._auth_headers = auth_headers
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(
                connector=connector, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self,
        endpoint: str,
        path: str,
        body: bytes,
        request_id: str,
        timeout_s: float,
        extra_headers: dict[str, str] | None = None,
    ) -> PrefillResult:
        """POST the P body to `endpoint`; PrefillResult on 2xx, else a LegError is raised."""
        headers = {
            "content-type": "application/json",
            **self._auth_headers(),
            **(extra_headers or {}),
            "x-request-id": request_id,
        }
        session = self.session
        started = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)
        try:
            async with session.post(
                f"http://{endpoint}{path}", data=body, headers=headers, timeout=timeout
            ) as response:
                payload = await response.read()
                status = response.status
        # ConnectionTimeoutError is a TimeoutError too: it comes first.
        except aiohttp.ConnectionTimeoutError:
            why = f"no connection within {self._connect_timeout_s:g} s"
            raise _unreachable(endpoint, why) from None
        except aiohttp.ClientConnectorError as error:
            raise _unreachable(endpoint, error.strerror or "connection refused") from None
        except TimeoutError:
            raise PrefillTimeout(
                504, f"prefill endpoint {endpoint} did not answer within {timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as error:
            raise _unreachable(endpoint, f"the connection broke: {error}") from None
        return prefill_result(status, None, payload, endpoint, started)


def _unreachable(endpoint: str, why: str) -> PrefillUnreachable:
    return PrefillUnreachable(
        503, f"prefill endpoint {endpoint} is unreachable ({why}); retry", retry_after_s=1
    )
