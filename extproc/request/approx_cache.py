"""What the engines probably hold of a request that is not tokenized, from what this sidecar sent
them: kv_cache's view where neither KV events nor a tokenizer can tell.

The prompt is the raw JSON bytes of a completion's `prompt` or a chat's `messages`; what a chat
template renders ahead of the messages (`tools`, `chat_template_kwargs`) starts its chain, so
that a prompt is credited only where it went with the same. Its size and each engine's share
are counted in tokens estimated as the decision estimates them (bytes / `bytes_per_token`), so
the kv_cache policy weighs them against the engines' queues as it weighs an index's tokens,
and the decision counts only what D probably lacks: of what D was sent, only what has reached
it (`KvRouting.land`, once D answers: after P, for a P/D request), since a prompt still
queued at P is not on D yet.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from extproc.policies import PickRequest
from extproc.request.parse import Api, ClientRequest
from extproc.request.prompt_size import TOKENIZED, prompt_bytes

if TYPE_CHECKING:
    from extproc.kvcache.routing import KvRouting
    from extproc.kvcache.scope import CacheScope

__all__ = ["approximate"]

_PROMPT = {Api.CHAT: "messages", Api.COMPLETIONS: "prompt"}
_AHEAD = ("tools", "chat_template_kwargs")  # a chat's: rendered ahead of the messages, if at all


def approximate(
    request: ClientRequest,
    wanted: PickRequest,
    kv: KvRouting,
    bytes_per_token: float,
    scope: CacheScope | None = None,
) -> tuple[PickRequest, list[int]]:
    """`wanted` with the prompt's estimated tokens and, per engine, those it was sent, and
    the prompt's block keys (for `KvRouting.remember_bytes` once routed), for a request of a
    group that `kv` approximates; `scope`: the request's, if already known."""
    parts = dict(request.parts)
    prompt = parts.get(_PROMPT[request.api], b"")
    ahead = b"".join(k.encode() + b"=" + parts[k] + b"\n" for k in _AHEAD if k in parts)
    if scope is None:
        scope = kv.scope_of(request.model, request.doc)
    keys = kv.routed_bytes.keys(prompt, scope, ahead)
    counted = TOKENIZED[request.api]
    size = sum(len(raw) for key, raw in request.parts if key in counted)
    held = kv.routed_bytes.held(keys) if keys else {}
    landed = kv.routed_bytes.landed(keys, held) if held else {}
    approximated = dataclasses.replace(
        wanted,
        prompt_bytes=prompt_bytes(request, counted),  # what the estimate below does not count
        prompt_tokens=math.ceil(size / bytes_per_token),
        cached={engine: int(sent / bytes_per_token) for engine, sent in held.items()},
        landed={engine: int(there / bytes_per_token) for engine, there in landed.items()},
    )
    return approximated, keys
