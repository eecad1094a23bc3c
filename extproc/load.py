"""Engine load for load-aware policies: scrape `/metrics` and keep `EndpointState` fresh.

`power_of_two` weighs each endpoint by the engine's own queue (`vllm:num_requests_waiting`)
and KV cache fill (`vllm:kv_cache_usage_perc`), which see load this sidecar did not send.
One task per runtime scrapes every endpoint of the pools whose policy needs it, all at once,
every `load_interval_s` (the smallest of those pools'); pools, members and policies are
re-read each round, so discovery and reloads need nothing from it. Engines that do not
export a metric count as 0 for it; an engine that does not answer keeps its last values (the
health checker decides whether it is used).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import aiohttp

from extproc.periodic import Periodic
from extproc.picking import ENGINE_LOAD_POLICIES

if TYPE_CHECKING:
    from extproc.config import Config
    from extproc.pool import EndpointState, Pool

__all__ = ["LoadScraper", "parse_load"]


def _sample(name: str) -> re.Pattern[bytes]:
    # One sample line of `name` with any labels; the trailing space keeps
    # vllm:num_requests_waiting from matching vllm:num_requests_waiting_by_reason.
    return re.compile(rb"^" + re.escape(name.encode()) + rb"(?:\{[^}]*\})? (\S+)", re.MULTILINE)


_WAITING = _sample("vllm:num_requests_waiting")
_KV_USAGE = _sample("vllm:kv_cache_usage_perc")
_GPU_CACHE_USAGE = _sample("vllm:gpu_cache_usage_perc")  # its name before vLLM 0.10


def _values(pattern: re.Pattern[bytes], text: bytes) -> list[float]:
    return [float(m.group(1)) for m in pattern.finditer(text)]


def parse_load(text: bytes) -> tuple[float, float]:
    """(waiting, kv_usage) from Prometheus text; 0 for a metric the engine does not export.

    A server with several data-parallel engines exports one sample per engine: their queues
    add up, their caches are averaged (each request lands in one of them).
    """
    waiting = sum(_values(_WAITING, text))
    usage = _values(_KV_USAGE, text) or _values(_GPU_CACHE_USAGE, text)
    return waiting, (sum(usage) / len(usage) if usage else 0.0)


def load_aware_pools(prefill: Pool, decode: Pool, config: Config) -> list[Pool]:
    pools = ((prefill, config.prefill), (decode, config.decode))
    return [pool for pool, cfg in pools if cfg.policy in ENGINE_LOAD_POLICIES]


class LoadScraper:
    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        config: Callable[[], Config],  # the current config: a reload swaps it
    ) -> None:
        self._prefill, self._decode = prefill, decode
        self._config = config
        self._periodic = Periodic("load-scrape", self._scrape_round, self._interval_s)
        self._session: aiohttp.ClientSession | None = None

    def _interval_s(self) -> float:
        config = self._config()
        configs = (config.prefill, config.decode)
        aware = [c.load_interval_s for c in configs if c.policy in ENGINE_LOAD_POLICIES]
        return min(aware, default=1.0)

    async def start(self, session: aiohttp.ClientSession) -> None:
        """One round now, so the first requests already see the engines' queues, then a task.

        The task runs even without a load-aware policy (its rounds then scrape nothing):
        pools, members and policies are re-read every round, so a reload can switch them.
        """
        self._session = session
        await self.scrape_all(session)  # bounded: each scrape has a timeout
        self._periodic.start(first_now=False)

    async def _scrape_round(self) -> None:
        assert self._session is not None
        await self.scrape_all(self._session)

    async def stop(self) -> None:
        await self._periodic.stop()

    async def scrape_all(self, session: aiohttp.ClientSession) -> None:
        pools = load_aware_pools(self._prefill, self._decode, self._config())
        states: Sequence[EndpointState] = [s for pool in pools for s in pool]
        await asyncio.gather(*(self._scrape(session, state) for state in states))

    async def _scrape(self, session: aiohttp.ClientSession, state: EndpointState) -> None:
        # A scrape slower than the interval is stale by the time it lands: bound it by both.
        timeout = min(self._interval_s(), self._config().health.timeout_s)
        try:
            async with session.get(
                f"http://{state.address}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                if response.status != 200:
                    return
                text = await response.read()
        except (aiohttp.ClientError, TimeoutError):
            return
        state.waiting, state.kv_usage = parse_load(text)
