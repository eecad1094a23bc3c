"""Engine load for load-aware policies, read from the engines' scraped metrics.

`power_of_two` weighs each endpoint by the engine's own queue (`vllm:num_requests_waiting`)
and KV cache fill (`vllm:kv_cache_usage_perc`), which see load this sidecar did not send; the
decode-only decision (`extproc.scheduling.decision`) and admission control
(`extproc.scheduling.admission`) also read the batch size (`vllm:num_requests_running`). The
engine scraper (`extproc.engines.scraper`) hands every fetched page here; the values land on the
endpoint's state in the pool. Engines that do not export a metric count as 0 for it; an engine
that does not answer keeps its last values (the health checker decides whether it is used).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from extproc.config import MAX_DATA_PARALLEL
from extproc.engines.scraper import Families

if TYPE_CHECKING:
    from extproc.scheduling.pool import EndpointState

__all__ = ["EngineLoad", "parse_load"]

_KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # 2nd: vLLM < 0.10


def _values(families: Families, name: str) -> list[float]:
    family = families.get(name)
    return [] if family is None else [s.value for s in family.samples if s.name == name]


def parse_load(families: Families) -> tuple[float, float, float]:
    """(waiting, running, kv_usage); 0 for a metric the engine does not export.

    A server with several data-parallel engines exports one sample per engine: their queues
    and batches add up, their caches are averaged (each request lands in one of them).
    """
    waiting = sum(_values(families, "vllm:num_requests_waiting"))
    running = sum(_values(families, "vllm:num_requests_running"))
    usage = next((v for name in _KV_USAGE_NAMES if (v := _values(families, name))), [])
    return waiting, running, (sum(usage) / len(usage) if usage else 0.0)


def rank_loads(families: Families) -> dict[int, float]:
    """Waiting + running requests per data-parallel engine (the `engine` label vLLM puts on
    each rank's series); empty for an engine without the label. A label past the configurable
    maximum is ignored: each rank found is followed (KV events, identity), so a page must not
    set how many."""
    loads: dict[int, float] = {}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        family = families.get(name)
        for sample in [] if family is None else family.samples:
            engine = sample.labels.get("engine", "")
            if sample.name == name and engine.isdigit() and int(engine) < MAX_DATA_PARALLEL:
                loads[int(engine)] = loads.get(int(engine), 0.0) + sample.value
    return loads


class EngineLoad:
    """A scraper consumer: the engine's load onto its endpoint state."""

    families = ("vllm:num_requests_waiting", "vllm:num_requests_running", *_KV_USAGE_NAMES)

    def __init__(
        self,
        endpoint: Callable[[str], EndpointState | None],
        ranks_changed: Callable[[str], None] = lambda address: None,
    ) -> None:
        self._endpoint = endpoint  # address → its state in a pool (None: not a member)
        self._ranks_changed = ranks_changed  # its page shows another number of DP ranks

    def consume(self, address: str, families: Families) -> None:
        state = self._endpoint(address)
        if state is not None:
            state.waiting, state.running, state.kv_usage = parse_load(families)
            ranks = state.scraped_ranks
            state.rank_load = {
                rank: max(0.0, load - state.rank_in_flight.get(rank, 0))
                for rank, load in rank_loads(families).items()
            }
            if state.scraped_ranks != ranks:
                self._ranks_changed(address)
            # what the engine has beyond this sidecar's processes' requests (ours and peers')
            state.refresh_peers()
            ours = state.in_flight + state.peer_in_flight
            state.foreign = max(0.0, state.running + state.waiting - ours)
