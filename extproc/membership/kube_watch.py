"""One kind of Kubernetes object kept current: list once, then watch from the list's version.

The loop is Kubernetes' own informer pattern. A watch resumes from the last resourceVersion
it saw (an event's, or a BOOKMARK's), so a reconnect misses nothing and replays nothing. When
the server no longer has that version (410 Gone), the objects are listed again. Any other
failure (the API down, a refused token, a reset connection), and a watch that ends at once
without an event (an empty 200), keeps the objects as they were; every re-open waits a
jittered pause that doubles while the watches fail and is back to the first once one
delivers. A streak's first failure is logged, the rest only at debug level, and the recovery
again.

Each object is parsed as it arrives (`parse`: its value, None when it is of no interest, or
`Malformed`); a malformed one counts as absent, with one warning per object however many
watches see it (`Complaints`; again at most every ten minutes while it stays malformed).
`on_change` receives what changed: key → the new
value, None for one gone. A burst of events is applied in slices of `_EVENTS_PER_SLICE`, each
followed by a turn of the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import aiohttp

from extproc.membership.kube_api import ApiError, Gone, KubeApi, Query
from extproc.membership.kube_objects import Malformed
from extproc.stopping import cancel_and_wait

__all__ = ["Changes", "Complaints", "Watched"]

log = logging.getLogger("extproc.membership.discovery")

T = TypeVar("T")
Changes = dict[str, T | None]  # "namespace/name" → its value now; None: gone or not of interest

_WARN_EVERY_S = 600.0  # a malformed object that stays so is warned about this often
_COMPLAINTS_KEPT = 10_000  # malformed objects remembered (beyond: the oldest is forgotten)
_HEALTHY_OPEN_S = 10.0  # a watch open this long without events is a quiet one, not a failure
_EVENTS_PER_SLICE = 64  # events applied between two turns of the event loop
_NO_NAME = "(no name)"  # the complaint key of objects that cannot be told apart


class _EmptyWatch(Exception):
    def __str__(self) -> str:
        return "the watch ended at once, without an event"


def _key(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return None
    name, namespace = meta.get("name"), meta.get("namespace", "")
    if not isinstance(name, str) or not name or not isinstance(namespace, str):
        return None
    return f"{namespace}/{name}"


def _version(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return version if isinstance(version, str) and version else None


class Complaints:
    """The warnings about malformed objects: one per object, however many events bring it and
    however many watches see it, repeated at most every `_WARN_EVERY_S`."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # "pods default/p-0" → when it was warned about

    def malformed(self, key: str, why: str) -> None:
        now = asyncio.get_running_loop().time()
        last = self._last.pop(key, None)
        if last is not None and now - last < _WARN_EVERY_S:
            self._last[key] = last
            log.debug("%s skipped, still malformed: %s", key, why)
            return
        self._last[key] = now
        if len(self._last) > _COMPLAINTS_KEPT:
            del self._last[next(iter(self._last))]
        log.warning("%s skipped, malformed: %s (it counts once well-formed)", key, why)

    def forget(self, key: str) -> None:
        """The object is well-formed again, or gone."""
        self._last.pop(key, None)


class Watched(Generic[T]):
    """The current objects of one `Query`, parsed; `start` runs the loop, `stop` cancels it."""

    def __init__(
        self,
        api: KubeApi,
        query: Query,
        parse: Callable[[dict[str, Any]], T | None],
        on_change: Callable[[Changes[T]], None],
        watch_timeout_s: Callable[[], int],
        backoff_s: tuple[float, float] = (0.5, 30.0),  # first pause, longest pause
        complaints: Complaints | None = None,  # shared by the watches of one discovery
    ) -> None:
        self.query = query
        self.objects: dict[str, T] = {}
        self.synced = asyncio.Event()  # set once the first list is in
        self.resource_version: str | None = None  # where the next watch resumes
        self.malformed: set[str] = set()  # the keys whose last version was malformed
        self._api = api
        self._parse = parse
        self._on_change = on_change
        self._watch_timeout_s = watch_timeout_s
        self._backoff_s = backoff_s
        self._task: asyncio.Task[None] | None = None
        self._streak = 0  # re-opens in a row that delivered nothing
        self._complaints = complaints or Complaints()
        self._delivered = False  # the current watch delivered an event

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"watch {self.query.describe()}")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            listed = self.resource_version is None
            opened = loop.time()
            try:
                if listed:
                    await self._list()
                await self._watch()  # until the server ends it: then resume from where it was
                if not self._delivered and loop.time() - opened < _HEALTHY_OPEN_S:
                    raise _EmptyWatch
                self._answered()
            except Gone as error:
                self.resource_version = None
                if listed:  # even a fresh list's version is gone: a failure, paced
                    self._failed(error)
                else:
                    log.info("%s: resourceVersion expired, listing again", self.query.describe())
            except (ApiError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as error:
                self._failed(error)
            except _EmptyWatch as error:
                self._failed(error)
            except Exception as error:  # a bug must not end the watch silently
                log.exception("%s: unexpected failure", self.query.describe())
                self._failed(error)
            await asyncio.sleep(self._pause_s())

    async def _list(self) -> None:
        listing = await self._api.list(self.query)
        self.malformed.clear()
        parsed: dict[str, T] = {}
        for obj in listing.items:
            key, value = self._parsed(obj)
            if key is not None and value is not None:
                parsed[key] = value
        changes: Changes[T] = {k: None for k in self.objects if k not in parsed}
        changes.update({k: v for k, v in parsed.items() if self.objects.get(k) != v})
        self.objects = parsed
        self.resource_version = listing.resource_version
        self.synced.set()
        self._on_change(changes)  # even when empty: the first list is news

    async def _watch(self) -> None:
        assert self.resource_version is not None
        self._delivered = False
        events = self._api.watch(self.query, self.resource_version, self._watch_timeout_s())
        async with contextlib.aclosing(events):  # a cancelled watch closes its connection now
            applied = 0
            async for event in events:
                self._apply(event)
                applied += 1
                if applied % _EVENTS_PER_SLICE == 0:
                    # a burst already in the connection's buffer is read without a pause:
                    # let the requests run between slices of it
                    await asyncio.sleep(0)

    def _apply(self, event: dict[str, Any]) -> None:
        self._delivered = True
        self._answered()
        obj = event.get("object")
        kind = event.get("type")
        if not isinstance(obj, dict):
            self._complain(_NO_NAME, f"a {str(kind)[:20]} event without an object")
            return
        self.resource_version = _version(obj) or self.resource_version
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # a BOOKMARK: only its version counts
        key, value = self._parsed(obj) if kind != "DELETED" else (_key(obj), None)
        if key is None:
            return
        if kind == "DELETED":
            self.malformed.discard(key)
            self._complaints.forget(self._about(key))
        before = self.objects.pop(key, None) if value is None else self.objects.get(key)
        if value is not None:
            self.objects[key] = value
        if before != value:
            self._on_change({key: value})

    def _parsed(self, obj: Any) -> tuple[str | None, T | None]:
        """The object's key and value; a malformed one's value is None, with its warning."""
        key = _key(obj) if isinstance(obj, dict) else None
        if key is None:
            self._complain(_NO_NAME, "an object without metadata.name")
            return None, None
        try:
            value = self._parse(obj)
        except Malformed as error:
            self.malformed.add(key)
            self._complain(key, str(error))
            return key, None
        self.malformed.discard(key)
        self._complaints.forget(self._about(key))
        return key, value

    def _about(self, key: str) -> str:
        return f"{self.query.kind[2]} {key}"

    def _complain(self, key: str, why: str) -> None:
        self._complaints.malformed(self._about(key), why)

    def _answered(self) -> None:
        """A watch delivered (a list alone proves little: its watch may fail at once)."""
        if self._streak:
            log.info("%s: watching again", self.query.describe())
            self._streak = 0

    def _failed(self, error: BaseException) -> None:
        """One log line per streak of failures; each makes the next pause longer."""
        self._streak += 1
        what = f"{self.query.describe()}: watch failed, keeping the last members"
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        if self._streak == 1:
            log.warning("%s: %s", what, first_line)
        else:
            log.debug("%s (%d in a row): %s", what, self._streak, first_line)

    def _pause_s(self) -> float:
        """Before every re-open: the first pause after a good watch, doubling per failure."""
        first, longest = self._backoff_s
        pause: float = min(longest, first * 2**self._streak)
        return pause * random.uniform(0.8, 1.2)
