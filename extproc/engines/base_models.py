"""Which model each engine serves as its base, read from its scraped metrics.

vLLM labels its series with `model_name`: its base model's (first) served name, never a LoRA
adapter's. KV-cache routing keys a request for any other name as an adapter's
(`extproc.kvcache.scope`), so this is what lets base-model requests be credited with the
blocks the engines hold.
"""

from __future__ import annotations

from collections.abc import Callable

from extproc.engines.scraper import Families

__all__ = ["BaseModels"]

_FAMILY = "vllm:num_requests_running"  # every vLLM exports it, labelled with model_name


class BaseModels:
    """A scraper consumer: each engine's base model to `learn(address, model)`."""

    families = (_FAMILY,)

    def __init__(self, learn: Callable[[str, str], None]) -> None:
        self._learn = learn

    def consume(self, address: str, families: Families) -> None:
        family = families.get(_FAMILY)
        for sample in [] if family is None else family.samples:
            model = sample.labels.get("model_name")
            if model:
                self._learn(address, model)
                return
