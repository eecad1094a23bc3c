"""The Kubernetes API, as discovery needs it: list a kind of object, then watch it.

kubernetes-asyncio does the talking (its aiohttp session, TLS, the bearer token, re-read from
the file on every request because projected service-account tokens rotate). Objects stay the
API's JSON: discovery reads a few fields of pods and InferencePools, so nothing is
deserialised into models. This is the only module that imports the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api, CustomObjectsApi

from extproc.config import DiscoveryConfig

__all__ = ["INFERENCE_POOLS", "PODS", "ApiError", "Gone", "KubeApi", "Listing", "Query"]

# GIE v1: the InferencePool's group, version and plural
INFERENCE_POOLS = ("inference.networking.k8s.io", "v1", "inferencepools")
PODS = ("", "v1", "pods")
_LIST_TIMEOUT_S = 15.0


class ApiError(Exception):
    """The API answered with an error (a status other than 2xx, or an ERROR watch event)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status


class Gone(ApiError):
    """410: the resourceVersion is too old to resume from; list again."""


@dataclass(frozen=True)
class Query:
    """One kind of object in one namespace, narrowed by selectors."""

    kind: tuple[str, str, str]  # (group, version, plural); PODS or INFERENCE_POOLS
    namespace: str
    label_selector: str = ""
    field_selector: str = ""

    def describe(self) -> str:
        narrowed = ",".join(s for s in (self.label_selector, self.field_selector) if s)
        return f"{self.kind[2]} in {self.namespace}" + (f" ({narrowed})" if narrowed else "")


@dataclass(frozen=True)
class Listing:
    items: list[Any]  # each checked by its reader
    resource_version: str  # the list's: a watch from here misses nothing


def _error(status: int, body: bytes) -> ApiError:
    try:
        message = str(orjson.loads(body).get("message", ""))
    except (orjson.JSONDecodeError, AttributeError):
        message = body[:200].decode(errors="replace")
    return (Gone if status == 410 else ApiError)(status, message)


def _listing(listing: Any) -> Listing:
    """A list's items and version; ApiError when it is no list (the items are checked one by
    one, by their watch)."""
    metadata = listing.get("metadata") if isinstance(listing, dict) else None
    version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
    items = listing.get("items") or [] if isinstance(listing, dict) else None
    if not isinstance(version, str) or not version or not isinstance(items, list):
        raise ApiError(200, "the list has no metadata.resourceVersion or no items list")
    return Listing(items, version)


def _error_event(status: Any) -> ApiError:
    status = status if isinstance(status, dict) else {}
    code = status.get("code")
    code = code if isinstance(code, int) else 0
    return (Gone if code == 410 else ApiError)(code, str(status.get("message", ""))[:200])


class KubeApi:
    """Lists and watches through one kubernetes-asyncio client; `close` releases it."""

    def __init__(self, settings: DiscoveryConfig) -> None:
        self._configuration = Configuration(host=settings.kubernetes_api)
        ca = Path(settings.ca_file)
        if settings.kubernetes_api.startswith("https") and ca.exists():
            self._configuration.ssl_ca_cert = str(ca)
        self._configuration.api_key_prefix["BearerToken"] = "Bearer"
        self._token_file = Path(settings.token_file)
        self._client = ApiClient(self._configuration)
        self._core = CoreV1Api(self._client)
        self._custom = CustomObjectsApi(self._client)

    async def close(self) -> None:
        await self._client.close()

    async def list(self, query: Query) -> Listing:
        response = await self._call(query, _request_timeout=_LIST_TIMEOUT_S)
        async with response:
            body = await asyncio.wait_for(response.read(), _LIST_TIMEOUT_S)
        if response.status != 200:
            raise _error(response.status, body)
        return _listing(orjson.loads(body))

    async def watch(
        self, query: Query, resource_version: str, timeout_s: int
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The events after `resource_version` (ADDED, MODIFIED, DELETED, BOOKMARK) until the
        server ends the watch after `timeout_s`; raises Gone, ApiError or a connection error.

        The client's own deadline is a little later than the server's, so a connection that
        died silently ends too."""
        response = await self._call(
            query,
            watch=True,
            resource_version=resource_version,
            timeout_seconds=timeout_s,
            allow_watch_bookmarks=True,
            _request_timeout=timeout_s + 15,
        )
        async with response:
            if response.status != 200:
                raise _error(response.status, await response.read())
            async for line in response.content:
                if not line.strip():
                    continue
                event = orjson.loads(line)
                if not isinstance(event, dict):
                    raise ApiError(200, f"a watch event that is not an object: {line[:100]!r}")
                if event.get("type") == "ERROR":
                    raise _error_event(event.get("object"))
                yield event

    async def _call(self, query: Query, **params: Any) -> aiohttp.ClientResponse:
        group, version, plural = query.kind
        if query.label_selector:
            params["label_selector"] = query.label_selector
        if query.field_selector:
            params["field_selector"] = query.field_selector
        params["_preload_content"] = False  # the raw response: JSON and lines read here
        await self._use_current_token()
        if (group, version, plural) == PODS:
            response = await self._core.list_namespaced_pod(query.namespace, **params)
        else:
            response = await self._custom.list_namespaced_custom_object(
                group, version, query.namespace, plural, **params
            )
        assert isinstance(response, aiohttp.ClientResponse)
        return response

    async def _use_current_token(self) -> None:
        """The token file as it is now (none outside a pod: no Authorization header)."""
        token = await asyncio.to_thread(_read_if_exists, self._token_file)
        if token:
            self._configuration.api_key["BearerToken"] = token
        else:
            self._configuration.api_key.pop("BearerToken", None)


def _read_if_exists(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None
