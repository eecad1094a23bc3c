"""One kind of Kubernetes object kept current: list once, then watch from the list's version.

The loop is Kubernetes' own informer pattern. A watch resumes from the last resourceVersion
it saw (an event's, or a BOOKMARK's), so a reconnect misses nothing and replays nothing. When
the server no longer has that version (410 Gone), the objects are listed again. Any other
failure (the API down, a refused token, a reset connection) keeps the objects as they were and
retries with a growing pause; its first occurrence is logged, the rest only at debug level,
and the recovery again. `on_change` is called after every change, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

import aiohttp

from extproc.membership.kube_api import ApiError, Gone, KubeApi, Query
from extproc.stopping import cancel_and_wait

__all__ = ["Watched"]

log = logging.getLogger("extproc.membership.discovery")

Objects = dict[str, dict[str, Any]]  # "namespace/name" → the object's JSON


def _key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _version(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


class Watched:
    """The current objects of one `Query`; `start` runs the loop, `stop` cancels it."""

    def __init__(
        self,
        api: KubeApi,
        query: Query,
        on_change: Callable[[], None],
        watch_timeout_s: Callable[[], int],
        backoff_s: tuple[float, float] = (0.5, 30.0),  # first pause, longest pause
    ) -> None:
        self.query = query
        self.objects: Objects = {}
        self.synced = asyncio.Event()  # set once the first list is in
        self.resource_version: str | None = None  # where the next watch resumes
        self._api = api
        self._on_change = on_change
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._task: asyncio.Task[None] | None = None
        self._failures = 0  # in a row, since the API last answered

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"watch {self.query.describe()}")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def _run(self) -> None:
        while True:
            listed = self.resource_version is None
            try:
                if listed:
                    await self._list()
                await self._watch()  # until the server ends it: then resume from where it was
                self._answered()
            except Gone as error:
                self.resource_version = None
                if listed:  # even a fresh list's version is gone: pause, do not spin
                    await self._failed(error)
                else:
                    log.info("%s: resourceVersion expired, listing again", self.query.describe())
            except (ApiError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
                await self._failed(error)
            except Exception as error:  # a bug must not end the watch silently
                log.exception("%s: unexpected failure", self.query.describe())
                await self._failed(error)

    async def _list(self) -> None:
        listing = await self._api.list(self.query)
        self.objects = {_key(obj): obj for obj in listing.items}
        self.resource_version = listing.resource_version
        self.synced.set()
        self._on_change()

    async def _watch(self) -> None:
        assert self.resource_version is not None
        events = self._api.watch(self.query, self.resource_version, self._watch_timeout_s())
        async with contextlib.aclosing(events):  # a cancelled watch closes its connection now
            async for event in events:
                self._apply(event)

    def _apply(self, event: dict[str, Any]) -> None:
        self._answered()
        obj = event.get("object") or {}
        kind = event.get("type")
        if kind in ("ADDED", "MODIFIED"):
            self.objects[_key(obj)] = obj
        elif kind == "DELETED":
            self.objects.pop(_key(obj), None)
        self.resource_version = _version(obj) or self.resource_version
        if kind != "BOOKMARK":
            self._on_change()

    def _answered(self) -> None:
        """A watch delivered (a list alone proves little: its watch may fail at once)."""
        if self._failures:
            log.info("%s: watching again", self.query.describe())
            self._failures = 0

    async def _failed(self, error: BaseException) -> None:
        """One log line per streak of failures, then a growing pause before the next try."""
        self._failures += 1
        what = f"{self.query.describe()}: watch failed, keeping the last members"
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        if self._failures == 1:
            log.warning("%s: %s", what, first_line)
        else:
            log.debug("%s (%d in a row): %s", what, self._failures, first_line)
        await asyncio.sleep(self._pause_s())

    def _pause_s(self) -> float:
        first, longest = self._backoff_s
        pause: float = min(longest, first * 2 ** (self._failures - 1))
        return pause * random.uniform(0.8, 1.2)
