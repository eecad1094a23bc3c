"""session: one conversation, one endpoint (the session header is `dispatch.session_header`)."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.policies.base import E, NoOptions, PickRequest, hrw_order
from extproc.policies.least_request import LeastRequestPicker

__all__ = ["SessionPicker"]


class SessionPicker:
    """Rendezvous hashing of the session header's value.

    The endpoint holds the conversation's earlier turns in its prefix cache. Requests without
    the header are spread by in-flight count (least_request).
    """

    def __init__(self, options: NoOptions | None = None) -> None:
        self._fallback = LeastRequestPicker()

    def pick(self, candidates: Sequence[E], request: PickRequest) -> E:
        if not request.session:
            return self._fallback.pick(candidates, request)
        return hrw_order(request.session.encode(), candidates)[0]
