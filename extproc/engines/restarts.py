"""Engine restarts, seen in `process_start_time_seconds` before any request fails.

A restarted prefill engine has a new NIXL agent: its identity is stale, so it is dropped and
re-learned (vLLM and vllmsim both export the start time). Only a later start time is a
restart: an earlier one is an answer fetched before the restart and read after a newer one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from extproc.engines.scraper import Families

__all__ = ["RestartDetector"]

log = logging.getLogger("extproc.engines.health")


class RestartDetector:
    families = ("process_start_time_seconds",)

    def __init__(self, watched: Callable[[str], bool], on_restart: Callable[[str], None]) -> None:
        self._watched = watched  # which engines matter (the prefill ones)
        self._on_restart = on_restart
        self._start_times: dict[str, float] = {}

    def consume(self, address: str, families: Families) -> None:
        family = families.get("process_start_time_seconds")
        if family is None or not family.samples or not self._watched(address):
            return
        started = family.samples[0].value
        previous = self._start_times.get(address)
        if previous is not None and started <= previous:
            # The same process, or an answer older than one already read: the health check
            # and the load scraper fetch /metrics apart, and their answers may cross.
            return
        self._start_times[address] = started
        if previous is not None:
            log.warning("prefill %s restarted; its identity is dropped and re-learned", address)
            self._on_restart(address)

    def forget(self, address: str) -> None:
        self._start_times.pop(address, None)
