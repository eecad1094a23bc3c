"""Each engine's context length (vLLM's `max_model_len`), as its `/v1/models` says.

The health checker asks an engine once it is healthy and forgets the answer when it goes down
or restarts (it may come back with another length). What every engine of a model group said
lets the request path refuse a prompt that fits none of them before tokenizing it
(`KvRouting.fit_limit`); an engine that never says keeps that from happening.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import aiohttp

__all__ = ["ContextLengths", "served_context"]


async def served_context(
    session: aiohttp.ClientSession, address: str, timeout_s: float, headers: Mapping[str, str]
) -> int | None:
    """The context length the engine's `/v1/models` gives its model; None if it gives none
    or does not answer."""
    try:
        async with session.get(
            f"http://{address}/v1/models",
            headers=dict(headers),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            if response.status != 200:
                return None
            served = (await response.json())["data"][0]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return None
    length = served.get("max_model_len") if isinstance(served, dict) else None
    return length if type(length) is int and length > 0 else None


class ContextLengths:
    """Asks each healthy engine its context length once per healthy spell; `told` records
    an answer (None: forget it)."""

    def __init__(
        self,
        told: Callable[[str, int | None], None],
        ask: Callable[[aiohttp.ClientSession, str], Awaitable[int | None]],
    ) -> None:
        self._told = told
        self._ask = ask
        self._asked: set[str] = set()  # engines asked since they were last healthy

    async def health(self, session: aiohttp.ClientSession, address: str, healthy: bool) -> None:
        """The engine's health as a round found it."""
        if not healthy:
            self.forget(address)
        elif address not in self._asked:
            self._asked.add(address)
            self._told(address, await self._ask(session, address))

    def forget(self, address: str) -> None:
        """The engine went down, restarted or left: ask it again when it is healthy."""
        self._asked.discard(address)
        self._told(address, None)
