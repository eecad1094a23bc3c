"""Request bodies and answer parsing shared by the real-vLLM tests."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

MODEL = "tiny"
MAX_TOKENS = 8
# Distinct, each well under one 128-token KV block, so D never gets a local prefix-cache hit and
# every prompt token must come from P.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill engines compute the KV cache for the prompt.",
    "Decode engines generate the rest of the answer, one token at a time.",
    "Envoy hands the request body to an external processor.",
    "NIXL moves KV blocks between engines over UCX on loopback.",
    "0123456789 abcdefghij",
    "Hello world! This is a small test of disaggregated serving.",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ and some punctuation: .,;:!?",
    "A push connector writes the KV into blocks the decoder registered.",
    "A pull connector reads the KV from blocks the prefill engine kept.",
    "lazy dogs and quick foxes, again and again and again",
]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def body(kind: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    request: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}
    if kind == "chat":
        request["messages"] = [{"role": "user", "content": prompt}]
    else:
        request["prompt"] = prompt
    if stream:
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
    return request


@dataclass
class Answer:
    status: int
    text: str
    prompt_tokens: int
    raw: bytes


def sse_events(raw: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, in order (including b"[DONE]")."""
    return [frame[len(b"data: ") :] for frame in raw.split(b"\n\n") if frame.startswith(b"data: ")]


def parse(kind: str, status: int, raw: bytes, stream: bool) -> Answer:
    if status != 200:
        return Answer(status, "", 0, raw)
    if not stream:
        answer = orjson.loads(raw)
        choice = answer["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        return Answer(status, text or "", answer["usage"]["prompt_tokens"], raw)
    text, prompt_tokens = "", 0
    for event in sse_events(raw):
        if event == b"[DONE]":
            continue
        chunk = orjson.loads(event)
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content") if kind == "chat" else choice["text"]
            text += piece or ""
        if chunk.get("usage"):
            prompt_tokens = chunk["usage"]["prompt_tokens"]
    return Answer(status, text, prompt_tokens, raw)


async def ask(
    session: aiohttp.ClientSession,
    base_url: str,
    kind: str,
    prompt: str,
    stream: bool,
    headers: dict[str, str] | None = None,
) -> Answer:
    async with session.post(
        base_url + PATHS[kind], json=body(kind, prompt, stream), headers=headers
    ) as response:
        return parse(kind, response.status, await response.read(), stream)


# An engine's access log line for a request it answered with an error.
_ERROR_ACCESS = re.compile(r'"(?:POST|GET) [^"]+ HTTP/[\d.]+" [45]\d\d')
_FAILURE_WORDS = ("KeyError", "Traceback", "ERROR")


def log_problems(log: str) -> list[str]:
    """Lines of an engine log that show a request it failed or rejected."""
    return [
        line
        for line in log.splitlines()
        if _ERROR_ACCESS.search(line) or any(w in line for w in _FAILURE_WORDS)
    ]
