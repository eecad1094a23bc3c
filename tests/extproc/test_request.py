from __future__ import annotations

import pytest

from extproc.errors import ClientError
from extproc.request import Api, check_route, parse_request

LIMIT = 1000


@pytest.mark.parametrize(
    ("raw", "status", "fragment"),
    [
        (b"{not json", 400, "not valid UTF-8 JSON"),
        (b"[1,2]", 400, "JSON object"),
        (b'{"prompt":"p"}', 400, "'model'"),
        (b'{"model":"m","prompt":"p","max_tokens":"8"}', 400, "'max_tokens' must be an integer"),
        (b'{"model":"m","prompt":"p","n":2}', 400, "'n' greater than 1"),
        (b'{"model":"m","prompt":["a","b"]}', 400, "list of prompts"),
        (
            b'{"model":"m","prompt":"p","stream_options":{"include_usage":true}}',
            400,
            "only allowed when 'stream' is true",
        ),
        (b'{"model":"m","prompt":"\xff\xfe"}', 400, "UTF-8"),
        (b'{"model":"m","prompt":"' + b"x" * LIMIT + b'"}', 413, "limit is 1000 bytes"),
        (b"", 400, "no body"),
        (b'{"model":"m","prompt":"p","stream":"yes"}', 400, "'stream' must be a boolean"),
        (b'{"model":"m","prompt":"p","max_tokens":0}', 400, "at least 1"),
    ],
)
def test_bad_completion_bodies(raw: bytes, status: int, fragment: str) -> None:
    with pytest.raises(ClientError) as caught:
        parse_request(Api.COMPLETIONS, raw, LIMIT)
    assert caught.value.status == status
    assert fragment in caught.value.message


def test_chat_needs_messages() -> None:
    with pytest.raises(ClientError, match="messages"):
        parse_request(Api.CHAT, b'{"model":"m","prompt":"p"}', LIMIT)


def test_token_id_prompt_is_one_prompt() -> None:
    request = parse_request(Api.COMPLETIONS, b'{"model":"m","prompt":[1,2,3],"stream":true}', LIMIT)
    assert request.stream and request.model == "m"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v1/embeddings", 404),
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
    ],
)
def test_routes(method: str, path: str, status: int) -> None:
    with pytest.raises(ClientError) as caught:
        check_route(method, path)
    assert caught.value.status == status


def test_query_string_is_ignored_for_routing() -> None:
    assert check_route("POST", "/v1/completions?x=1") is Api.COMPLETIONS
