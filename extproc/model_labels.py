"""The `model` label of the metrics, bounded to the names the deployment knows.

The model is the client's own string: used as is, every invented name would make new series.
A name is kept when it is configured (`models:`) or served by an engine: learnt by the
identity probes from the engines' /v1/models, or from a decode engine accepting a request for
it (an engine refuses a name it does not serve). Any other name becomes "other".
"""

from __future__ import annotations

from collections.abc import Callable, Collection

__all__ = ["NO_MODEL", "OTHER_MODEL", "ModelLabels"]

OTHER_MODEL = "other"  # a name no engine serves and no config names
NO_MODEL = "none"  # the request ended before its model was read
_MAX_SERVED = 64  # more names than any pool serves; keeps the label bounded whatever happens


class ModelLabels:
    def __init__(self, configured: Callable[[], Collection[str]]) -> None:
        self._configured = configured  # the current config's model names (a reload swaps it)
        self._served: set[str] = set()

    def served(self, model: str) -> None:
        """An engine said it serves `model`."""
        if len(self._served) < _MAX_SERVED:
            self._served.add(model)

    def label(self, model: str, accepted: bool = False) -> str:
        """`model`'s label; `accepted`: a decode engine answered the request below 400."""
        if not model:
            return NO_MODEL
        if accepted:
            self.served(model)
        if model in self._served or model in self._configured():
            return model
        return OTHER_MODEL

    def known(self, label: str) -> str:
        """A label someone else wrote (Envoy's access-log entry): kept when this process could
        have written it, else "other"; it never adds a name."""
        if label in (NO_MODEL, OTHER_MODEL) or label in self._served or label in self._configured():
            return label
        return OTHER_MODEL
