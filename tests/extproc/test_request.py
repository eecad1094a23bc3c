from __future__ import annotations

import gzip

import pytest

from extproc.errors import ClientError
from extproc.request.parse import Api, check_route, parse_request

LIMIT = 1000


@pytest.mark.parametrize(
    ("raw", "status", "fragment"),
    [
        (b"{not json", 400, "the body is not valid JSON"),
        (b"[1,2]", 400, "JSON object"),
        (b'{"prompt":"p"}', 400, "'model'"),
        (b'{"model":"m","prompt":"p","max_tokens":"8"}', 400, "'max_tokens' must be an integer"),
        (b'{"model":"m","prompt":"p","n":2}', 400, "'n' is 2;"),
        (b'{"model":"m","prompt":["a","b"]}', 400, "list of 2 prompts"),
        (
            b'{"model":"m","prompt":"p","stream_options":{"include_usage":true}}',
            400,
            "only allowed when 'stream' is true",
        ),
        (b'{"model":"m","prompt":"\xff\xfe"}', 400, "UTF-8"),
        (b'{"model":"m","prompt":"' + b"x" * LIMIT + b'"}', 413, "limit is 1000 bytes"),
        (b"", 400, "no body"),
        (b'{"model":"m","prompt":"p","stream":"yes"}', 400, "'stream' must be true or false"),
        (b'{"model":"m","prompt":"p","max_tokens":0}', 400, "at least 1"),
    ],
)
def test_bad_completion_bodies(raw: bytes, status: int, fragment: str) -> None:
    with pytest.raises(ClientError) as caught:
        parse_request(Api.COMPLETIONS, raw, LIMIT)
    assert caught.value.status == status
    assert fragment in caught.value.message


# Each message names what is wrong; `wrong` is what an earlier message said instead.
@pytest.mark.parametrize(
    ("raw", "says", "wrong"),
    [
        (b'{"model":"m","prompt":"p","n":0}', "'n' is 0; ", "greater than 1"),
        (b'{"model":"m","prompt":"p","n":-1}', "so 'n' must be 1", "greater than 1"),
        (b'{"model":"m","prompt":[]}', "'prompt' is an empty list", "list of prompts"),
        (b'{"model":"m","prompt":["a"]}', "a list holding one prompt", "list of prompts is"),
        (b'{"model":"m","prompt":[1,"a"]}', "token ids (integers) only", "list of prompts"),
        (gzip.compress(b'{"model":"m","prompt":"p"}'), "gzip-compressed", "surrogates"),
        (b'{"model":"m","prompt":"caf\xe9"}', "not UTF-8 text (byte 0xe9 at offset 26)", "surr"),
        (b'{"model":"m","prompt":"p","max_tokens":' + str(2**63).encode() + b"}",
         f"is {2**63}, too large; the largest accepted is 2147483647", None),
        (b'{"model":"m","prompt":"p","max_tokens":' + str(2**70).encode() + b"}",
         "'max_tokens' is too large; the largest accepted is 2147483647", "must be an integer"),
        (b'{"model":"m","prompt":"p","max_tokens":-' + str(2**70).encode() + b"}",
         "'max_tokens' must be at least 1", "too large"),
        (b'{"model":"m","prompt":"p","max_tokens":2147483648}', "too large", None),
        (b'{"model":"m","prompt":"p","max_tokens":2.5}', "must be an integer (it is 2.5)", None),
        (b'{"model":"m","prompt":"p","min_tokens":-1}', "'min_tokens' must be at least 0", None),
        (b'{"model":"m","prompt":"p","stream":1}', "true or false (it is a number)", None),
        (b'{"model":"m","prompt":null}', "(it is null)", None),
    ],
)  # fmt: skip
def test_messages_name_what_is_wrong(raw: bytes, says: str, wrong: str | None) -> None:
    with pytest.raises(ClientError) as caught:
        parse_request(Api.COMPLETIONS, raw, 10_000)
    assert caught.value.status == 400
    assert says in caught.value.message
    assert wrong is None or wrong not in caught.value.message


def test_largest_max_tokens_is_accepted() -> None:
    raw = b'{"model":"m","prompt":"p","max_tokens":2147483647,"max_completion_tokens":1}'
    assert parse_request(Api.COMPLETIONS, raw, LIMIT).doc["max_tokens"] == 2**31 - 1


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
