"""Which engines the scraper fetches, and how often: address → interval in seconds.

- every member of every pool whose policy needs engine load (the top-level pools and each
  `models:` group alike), at that pool's `load_interval_s`;
- every decode engine at `kv_check.interval_s`, when the KV check is on;
- every member of a pool with `kv_events` at `health.interval_s`: an engine's restart (its
  `process_start_time_seconds`) clears its KV-cache entries;
- every member of a pool with data-parallel ranks (its `data_parallel_size`, or an endpoint's),
  at the pool's `load_interval_s`: each rank's queue weighs the choice of rank;
- every member at `decision.load_interval_s` / `admission.load_interval_s` when the
  load-aware decision / admission control is on.
An engine wanted by several gets the smallest interval. Prefill engines are also scraped by
the health checker every `health.interval_s` (restart detection rides on that fetch).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from extproc.config import Config, DecisionMode
from extproc.roles import Role

__all__ = ["scrape_plan"]


def scrape_plan(
    config: Config,
    members: Mapping[str, Mapping[Role, Collection[str]]],
    decodes: Collection[str],
) -> dict[str, float]:
    """`members`: model ("" for the top-level pools) → role → its current members."""
    plan: dict[str, float] = {}

    def want(addresses: Collection[str], interval_s: float) -> None:
        for address in addresses:
            plan[address] = min(plan.get(address, interval_s), interval_s)

    for model, group in config.groups().items():
        for role in Role:
            pool = getattr(group, role)
            ranked = (pool.data_parallel_size or 1) > 1 or any(
                (e.data_parallel_size or 1) > 1 for e in pool.endpoints
            )
            if (pool.needs_load or ranked) and model in members:
                want(members[model].get(role, ()), pool.load_interval_s)
            if pool.kv_events is not None and model in members:
                want(members[model].get(role, ()), config.health.interval_s)
    if config.kv_check.enabled:
        want(decodes, config.kv_check.interval_s)
    every = [a for group in members.values() for role in Role for a in group.get(role, ())]
    if config.decision.mode is DecisionMode.LOAD_AWARE:
        want(every, config.decision.load_interval_s)
    if config.admission.enabled:
        want(every, config.admission.load_interval_s)
    return plan
