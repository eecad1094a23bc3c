"""A fake Kubernetes API server for tests: pods and InferencePools, listed and watched.

    async with fake_kube_api() as kube:      # aiohttp on 127.0.0.1:<ephemeral>, kube.url
        kube.put_pod(pod("p-0", "127.0.0.2", labels={"llm-d.ai/role": "prefill"}))
        kube.put_pool(inference_pool("llama", {"app": "vllm"}, 8000))

It keeps one resourceVersion counter, like etcd, and a history of every change. A list
answers the current objects and the current version; `?watch=1` streams, chunked, one JSON
event per line, the changes after the `resourceVersion` asked for, then every new one, until
`timeoutSeconds` or `close_watches()`. `compact()` forgets the history, so a watch from an
older version gets a 410 Gone ERROR event (as the real server answers it; or the HTTP status,
with `gone_as_status`); `fail(n)` makes
the next n requests answer 500. Selectors: labelSelector "k=v,k2=v2" (also "k!=v"),
fieldSelector "metadata.name=x". Every request is recorded in `requests`.

A hostile server too: `put_raw` stores any JSON and hands it to every list and watch of its
kind (no selector applies: it may have no labels, no metadata at all); `watch_mode` "empty"
answers every watch with an empty 200, "closed" with a stream that ends after its headers,
"garbage" with a line that is JSON but no event.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

__all__ = ["FakeKubeApi", "fake_kube_api", "inference_pool", "pod"]

POOLS_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
PODS_PATH = "/api/v1/namespaces/{namespace}/pods"


def pod(
    name: str,
    ip: str,
    labels: dict[str, str] | None = None,
    *,
    namespace: str = "default",
    ready: bool = True,
    phase: str = "Running",
    terminating: bool = False,
) -> dict[str, Any]:
    """A pod as the API shows it (only the fields discovery reads)."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels or {}}
    if terminating:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "status": {"phase": phase, "podIP": ip, "conditions": [condition]},
    }


def inference_pool(
    name: str, match_labels: dict[str, str], port: int, *, namespace: str = "default"
) -> dict[str, Any]:
    """A GIE v1 InferencePool."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": match_labels},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": f"{name}-epp", "portNumber": 9002},
        },
    }


def _matches(obj: dict[str, Any], labels: str, fields: str) -> bool:
    meta = obj["metadata"]
    have = meta.get("labels") or {}
    for term in filter(None, labels.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if have.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if have.get(key) != value:
                return False
        elif term not in have:
            return False
    for term in filter(None, fields.split(",")):
        key, value = term.split("=", 1)
        if key == "metadata.name" and meta["name"] != value:
            return False
        if key == "metadata.namespace" and meta["namespace"] != value:
            return False
    return True


@dataclass
class _Change:
    version: int
    kind: str  # "pods" or "inferencepools"
    type: str  # ADDED, MODIFIED, DELETED
    obj: Any
    raw: bool = False  # put_raw's: to every watch of its kind, whatever it holds


@dataclass
class FakeKubeApi:
    url: str = ""
    version: int = 100
    objects: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    raw: set[tuple[str, str, str]] = field(default_factory=set)  # the keys put_raw stored
    history: list[_Change] = field(default_factory=list)
    oldest: int = 100  # the oldest version a watch may resume from (compact() moves it)
    requests: list[dict[str, str]] = field(default_factory=list)  # query + path + auth
    failures: int = 0  # the next this many requests answer 500
    gone_as_status: bool = False  # 410 as the HTTP status, not as an ERROR event in a 200
    watch_mode: str = ""  # "empty": an empty 200; "closed": ended after its headers; "garbage"
    _tick: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) on news
    _watch_epoch: int = 0  # close_watches() bumps it: open watches end
    _versions: list[int] = field(default_factory=list)  # the history's, to find the news fast

    # --- what a test does -------------------------------------------------------------
    def put_pod(self, obj: dict[str, Any]) -> None:
        self._put("pods", obj)

    def put_pool(self, obj: dict[str, Any]) -> None:
        self._put("inferencepools", obj)

    def put_raw(self, kind: str, name: str, obj: Any, namespace: str = "default") -> None:
        """Store `obj` as it is under `name` (its resourceVersion set if it has metadata)."""
        obj = copy.deepcopy(obj)
        key = (kind, namespace, name)
        self.version += 1
        if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict):
            obj["metadata"]["resourceVersion"] = str(self.version)
        change = "MODIFIED" if key in self.objects else "ADDED"
        self.objects[key] = obj
        self.raw.add(key)
        self._record(_Change(self.version, kind, change, obj, raw=True))

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        self._delete("pods", namespace, name)

    def delete_pool(self, name: str, namespace: str = "default") -> None:
        self._delete("inferencepools", namespace, name)

    def bookmark(self) -> None:
        """A BOOKMARK to every open watch: the current version, no object change."""
        self.version += 1
        self._record(_Change(self.version, "*", "BOOKMARK", {}))

    def compact(self) -> None:
        """Forget the history: watches from an older version get 410 Gone."""
        self.oldest = self.version
        self.history.clear()
        self._versions.clear()

    def close_watches(self) -> None:
        """End every open watch stream (as an API server restart or a proxy would)."""
        self._watch_epoch += 1
        self._notify()

    def fail(self, n: int) -> None:
        self.failures = n

    def watches(self, kind: str) -> list[dict[str, str]]:
        return [r for r in self.requests if r["kind"] == kind and r.get("watch")]

    def lists(self, kind: str) -> list[dict[str, str]]:
        return [r for r in self.requests if r["kind"] == kind and not r.get("watch")]

    # --- the store --------------------------------------------------------------------
    def _put(self, kind: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        key = (kind, meta.get("namespace", "default"), meta["name"])
        self.version += 1
        meta["resourceVersion"] = str(self.version)
        change = "MODIFIED" if key in self.objects else "ADDED"
        self.objects[key] = obj
        self.raw.discard(key)
        self._record(_Change(self.version, kind, change, obj))

    def _delete(self, kind: str, namespace: str, name: str) -> None:
        key = (kind, namespace, name)
        obj = copy.deepcopy(self.objects.pop(key))
        self.version += 1
        raw = key in self.raw
        self.raw.discard(key)
        if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict):
            obj["metadata"]["resourceVersion"] = str(self.version)
        self._record(_Change(self.version, kind, "DELETED", obj, raw=raw))

    def _record(self, change: _Change) -> None:
        self.history.append(change)
        self._versions.append(change.version)
        self._notify()

    def _notify(self) -> None:
        self._tick.set()
        self._tick = asyncio.Event()

    # --- HTTP -------------------------------------------------------------------------
    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        query = request.query
        watching = query.get("watch") in ("1", "true", "True")
        self.requests.append(
            {
                "kind": kind,
                "path": request.path,
                "auth": request.headers.get("authorization", ""),
                **({"watch": "1"} if watching else {}),
                **{k: v for k, v in query.items() if k != "watch"},
            }
        )
        if self.failures:
            self.failures -= 1
            return _status(500, "InternalError", "injected failure")
        namespace = request.match_info["namespace"]
        labels, fields = query.get("labelSelector", ""), query.get("fieldSelector", "")
        if not watching:
            items = [
                obj
                for key, obj in sorted(self.objects.items(), key=lambda item: item[0])
                if key[:2] == (kind, namespace)
                and (key in self.raw or _matches(obj, labels, fields))
            ]
            return web.json_response(
                {
                    "kind": "List",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                },
                dumps=lambda o: orjson.dumps(o).decode(),
            )
        return await self._watch(request, kind, namespace, labels, fields)

    async def _watch(
        self, request: web.Request, kind: str, namespace: str, labels: str, fields: str
    ) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.version)
        timeout_s = float(request.query.get("timeoutSeconds") or 1800)
        if since < self.oldest and self.gone_as_status:
            return _status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
        if self.watch_mode == "empty":
            return web.Response(status=200, content_type="application/json")
        response = web.StreamResponse(headers={"content-type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if self.watch_mode == "closed":
            return response
        if self.watch_mode == "garbage":
            await response.write(b'["no", "event"]\n')
            return response
        if since < self.oldest:
            gone = {
                "kind": "Status",
                "code": 410,
                "reason": "Expired",
                "message": f"too old resource version: {since} ({self.oldest})",
            }
            await response.write(orjson.dumps({"type": "ERROR", "object": gone}) + b"\n")
            return response
        epoch = self._watch_epoch
        deadline = asyncio.get_running_loop().time() + timeout_s
        sent = since
        while epoch == self._watch_epoch:
            tick = self._tick  # taken before reading the history: no change slips between
            news = self.history[bisect.bisect_right(self._versions, sent) :]
            for change in news:
                sent = change.version
                if change.type == "BOOKMARK":
                    marker = {"kind": kind, "metadata": {"resourceVersion": str(sent)}}
                    await _event(response, "BOOKMARK", marker)
                elif _sent_to(change, kind, namespace, labels, fields):
                    await _event(response, change.type, change.obj)
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tick.wait(), remaining)
        return response


def _sent_to(change: _Change, kind: str, namespace: str, labels: str, fields: str) -> bool:
    """Whether a watch of `kind` in `namespace`, narrowed by selectors, gets `change`."""
    if change.kind != kind:
        return False
    if change.raw:  # a hostile server's: to every watch of its kind
        return True
    return change.obj["metadata"]["namespace"] == namespace and _matches(change.obj, labels, fields)


async def _event(response: web.StreamResponse, kind: str, obj: Any) -> None:
    await response.write(orjson.dumps({"type": kind, "object": obj}) + b"\n")


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return web.json_response(body, status=code)


@contextlib.asynccontextmanager
async def fake_kube_api() -> AsyncIterator[FakeKubeApi]:
    fake = FakeKubeApi()
    app = web.Application()

    async def pods(request: web.Request) -> web.StreamResponse:
        return await fake.handle(request, "pods")

    async def pools(request: web.Request) -> web.StreamResponse:
        return await fake.handle(request, "inferencepools")

    app.router.add_get(PODS_PATH, pods)
    app.router.add_get(POOLS_PATH, pools)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake
    finally:
        fake.close_watches()
        await runner.cleanup()
