"""Parsing a client's request: what a client gets back for each request the sidecar refuses, and
what it lets through.

The refusal is the client's whole answer, so it is compared in full: status, and the
OpenAI-style error body (message, type, param, code) that names the offending field.
"""

from __future__ import annotations

import gzip
from typing import Any

import orjson
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
        (
            b'{"model":"m","prompt":"p","max_tokens":' + str(2**63).encode() + b"}",
            f"is {2**63}, too large; the largest accepted is 2147483647",
            None,
        ),
        (
            b'{"model":"m","prompt":"p","max_tokens":' + str(2**70).encode() + b"}",
            "'max_tokens' is too large; the largest accepted is 2147483647",
            "must be an integer",
        ),
        (
            b'{"model":"m","prompt":"p","max_tokens":-' + str(2**70).encode() + b"}",
            "'max_tokens' must be at least 1",
            "too large",
        ),
        (b'{"model":"m","prompt":"p","max_tokens":2147483648}', "too large", None),
        (b'{"model":"m","prompt":"p","max_tokens":2.5}', "must be an integer (it is 2.5)", None),
        (b'{"model":"m","prompt":"p","min_tokens":-1}', "'min_tokens' must be at least 0", None),
        (b'{"model":"m","prompt":"p","stream":1}', "true or false (it is a number)", None),
        (b'{"model":"m","prompt":null}', "(it is null)", None),
    ],
)
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


MESSAGES = [{"role": "user", "content": "hi"}]


def refusal(api: Api, body: Any, limit: int = LIMIT) -> tuple[int, dict[str, Any]]:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(ClientError) as caught:
        parse_request(api, raw, limit)
    return caught.value.status, orjson.loads(caught.value.body)["error"]


def bad_request(message: str, param: str | None) -> tuple[int, dict[str, Any]]:
    return 400, {"message": message, "type": "BadRequestError", "param": param, "code": 400}


def prompt_type(it_is: str) -> tuple[int, dict[str, Any]]:
    message = f"'prompt' must be a string or a list of token ids (it is {it_is})"
    return bad_request(message, "prompt")


def one_choice(n: str) -> tuple[int, dict[str, Any]]:
    return bad_request(
        f"'n' is {n}; prefill/decode serves one choice per request, so 'n' must be 1 (or left out)",
        "n",
    )


MODEL = bad_request("'model' is required and must be a string", "model")
MESSAGES_LIST = bad_request("'messages' must be a non-empty list", "messages")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"model": "m"}, prompt_type("missing")),
        ({"model": "m", "prompt": 7}, prompt_type("a number")),
        (
            {"model": "m", "prompt": []},
            bad_request(
                "'prompt' is an empty list; send a string or a list of token ids", "prompt"
            ),
        ),
        (
            {"model": "m", "prompt": [1, True]},
            bad_request("'prompt' as a list must hold token ids (integers) only", "prompt"),
        ),
        (
            {"model": "m", "prompt": [[1, 2], [3]]},
            bad_request(
                "'prompt' is a list of 2 prompts; prefill/decode serves one prompt per request: "
                "send each in its own request",
                "prompt",
            ),
        ),
        ({"model": "", "prompt": "p"}, MODEL),
        ({"model": 3, "prompt": "p"}, MODEL),
        ({"model": "m", "prompt": "p", "n": 2}, one_choice("2")),
        ({"model": "m", "prompt": "p", "n": 0}, one_choice("0")),
        ({"model": "m", "prompt": "p", "n": 1.5}, one_choice("1.5")),
        (
            {"model": "m", "prompt": "p", "min_tokens": True},
            bad_request("'min_tokens' must be an integer (it is a boolean)", "min_tokens"),
        ),
        (
            {"model": "m", "prompt": "p", "max_completion_tokens": "8"},
            bad_request(
                "'max_completion_tokens' must be an integer (it is a string)",
                "max_completion_tokens",
            ),
        ),
        (
            {"model": "m", "prompt": "p", "max_tokens": 0},
            bad_request("'max_tokens' must be at least 1 (it is 0)", "max_tokens"),
        ),
        (
            {"model": "m", "prompt": "p", "max_completion_tokens": -3},
            bad_request(
                "'max_completion_tokens' must be at least 1 (it is -3)", "max_completion_tokens"
            ),
        ),
        (
            {"model": "m", "prompt": "p", "stream": "yes"},
            bad_request("'stream' must be true or false (it is a string)", "stream"),
        ),
        (
            {"model": "m", "prompt": "p", "stream": 1},
            bad_request("'stream' must be true or false (it is a number)", "stream"),
        ),
        (
            {"model": "m", "prompt": "p", "stream": True, "stream_options": [1]},
            bad_request("'stream_options' must be an object", "stream_options"),
        ),
        (
            {"model": "m", "prompt": "p", "stream_options": {}},
            bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options"),
        ),
        (
            {"model": "m", "prompt": "p", "stream": False, "stream_options": {}},
            bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options"),
        ),
        ([1, 2], bad_request("the body must be a JSON object", None)),
        (b"", bad_request("the request has no body; send a JSON object", None)),
    ],
)
def test_completion_refusals(body: Any, expected: tuple[int, dict[str, Any]]) -> None:
    assert refusal(Api.COMPLETIONS, body) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"model": "m", "prompt": "p"}, MESSAGES_LIST),
        ({"model": "m", "messages": []}, MESSAGES_LIST),
        ({"model": "m", "messages": {"role": "user"}}, MESSAGES_LIST),
        (
            {"model": "m", "messages": [*MESSAGES, "hi"]},
            bad_request("each message must be an object", "messages"),
        ),
        (
            {"model": "m", "messages": MESSAGES, "max_tokens": 0},
            bad_request("'max_tokens' must be at least 1 (it is 0)", "max_tokens"),
        ),
    ],
)
def test_chat_refusals(body: Any, expected: tuple[int, dict[str, Any]]) -> None:
    assert refusal(Api.CHAT, body) == expected


def test_body_that_is_not_json_names_the_problem() -> None:
    status, error = refusal(Api.COMPLETIONS, b'{"model": "m", "prompt": "\xff"}')
    assert (status, error["param"]) == (400, None)
    assert error["message"] == (
        "the body is not UTF-8 text (byte 0xff at offset 26); send JSON encoded as UTF-8"
    )
    status, error = refusal(Api.COMPLETIONS, b'{"model": "m",')
    assert (status, error["param"]) == (400, None)
    assert error["message"].startswith("the body is not valid JSON: ")


def test_body_over_the_limit_is_413_before_parsing() -> None:
    body = b"{" + b" " * (LIMIT - 2) + b"}"  # exactly the limit: accepted as far as size goes
    assert refusal(Api.COMPLETIONS, body) == MODEL
    status, error = refusal(Api.COMPLETIONS, b"x" * (LIMIT + 1))
    assert status == 413
    assert error == {
        "message": f"request body is {LIMIT + 1} bytes; the limit is {LIMIT} bytes",
        "type": "RequestTooLarge",
        "param": None,
        "code": 413,
    }


@pytest.mark.parametrize(
    ("body", "stream", "max_completion"),
    [
        ({"model": "m", "prompt": "p"}, False, False),
        ({"model": "m", "prompt": [1, 2], "stream": True, "stream_options": {}}, True, False),
        ({"model": "m", "prompt": "p", "stream": None, "n": 1, "max_tokens": 1}, False, False),
        ({"model": "m", "prompt": "p", "max_completion_tokens": 1, "min_tokens": 0}, False, True),
    ],
)
def test_accepted_completions(body: dict[str, Any], stream: bool, max_completion: bool) -> None:
    raw = orjson.dumps(body)
    request = parse_request(Api.COMPLETIONS, raw, LIMIT)
    assert (request.api, request.model, request.stream) == (Api.COMPLETIONS, "m", stream)
    assert request.has_max_completion_tokens is max_completion
    assert request.doc == body
    assert [key for key, _ in request.parts] == list(body)
    assert b"{" + b",".join(chunk for _, chunk in request.parts) + b"}" == raw


def test_accepted_chat() -> None:
    body = {"model": "chat-m", "messages": MESSAGES, "stream": True}
    request = parse_request(Api.CHAT, orjson.dumps(body), LIMIT)
    assert (request.api, request.model, request.stream) == (Api.CHAT, "chat-m", True)
    assert request.doc == body


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        (
            "POST",
            "/v1/embeddings?x=1",
            404,
            "/v1/embeddings is not served here; use /v1/chat/completions or /v1/completions",
        ),
        ("GET", "/v1/completions", 405, "GET is not allowed on /v1/completions; use POST"),
        (
            "POST",
            "/v1/chat/completions/",
            404,
            "/v1/chat/completions/ is not served here; use /v1/chat/completions or /v1/completions",
        ),
    ],
)
def test_route_refusals(method: str, path: str, status: int, message: str) -> None:
    with pytest.raises(ClientError) as caught:
        check_route(method, path)
    assert (caught.value.status, caught.value.message) == (status, message)


def test_routes_served() -> None:
    assert check_route("POST", "/v1/chat/completions") is Api.CHAT
    assert check_route("POST", "/v1/completions?a=b?c") is Api.COMPLETIONS


def test_the_clients_engine_priority_is_dropped_unless_allowed() -> None:
    raw = b'{"model":"m","prompt":"p","priority":-100,"pr\\u0069ority":-9,"top_k":2}'
    dropped = parse_request(Api.COMPLETIONS, raw, 1 << 20)
    assert [key for key, _ in dropped.parts] == ["model", "prompt", "top_k"]
    kept = parse_request(Api.COMPLETIONS, raw, 1 << 20, engine_priority=True)
    assert [key for key, _ in kept.parts] == ["model", "prompt", "priority", "priority", "top_k"]


def nested(depth: int) -> str:
    """JSON text of a value `depth` levels deep (objects and arrays in turn), written out:
    the JSON libraries refuse to encode a value that deep."""
    return '{"a":[' * (depth // 2) + ('{"a":"x"}' if depth % 2 else '"x"') + "]}" * (depth // 2)


DEPTH = bad_request(
    "the body's JSON is nested more than 64 levels deep; the limit is 64: flatten the deepest "
    "value",
    None,
)
DEEP = nested(1000)
USER = '{"model":"m","messages":[{"role":"user","content":"x"}],'


@pytest.mark.parametrize(
    ("api", "body"),
    [
        (Api.CHAT, '{"model":"m","messages":[{"role":"user","content":' + DEEP + "}]}"),
        (
            Api.CHAT,
            '{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":'
            + DEEP
            + "}]}]}",
        ),
        (Api.CHAT, USER + '"tools":' + DEEP + "}"),
        (Api.CHAT, USER + '"chat_template_kwargs":' + DEEP + "}"),
        (Api.COMPLETIONS, '{"model":"m","prompt":"p","user":' + nested(64) + "}"),  # 65 in all
    ],
    ids=["content", "text-part", "tools", "template-kwargs", "one-past-the-limit"],
)
def test_json_nested_too_deep_is_refused_naming_the_limit(api: Api, body: str) -> None:
    assert refusal(api, body.encode(), 1 << 20) == DEPTH


def test_nesting_up_to_the_limit_and_brackets_in_strings_are_accepted() -> None:
    brackets = '[[{{\\"[' * 200 + "\\\\" + "[" * 100
    user = orjson.loads(nested(63))
    body = {"model": "m", "prompt": brackets, "user": user, "x": [[brackets]] * 50}
    assert parse_request(Api.COMPLETIONS, orjson.dumps(body), 1 << 20).doc["prompt"] == brackets


@pytest.mark.parametrize(
    ("prompt", "wrong"),
    [([1, -1], -1), ([1, 2**40], 2**40), ([1, 2**63], 2**63), ([2**31, 5], 2**31)],
    ids=["negative", "2**40", "2**63", "2**31"],
)
def test_token_ids_outside_int32_are_refused(prompt: list[int], wrong: int) -> None:
    assert refusal(Api.COMPLETIONS, {"model": "m", "prompt": prompt}) == bad_request(
        f"'prompt' holds token id {wrong}; token ids are integers from 0 to 2147483647 and "
        "must be in the model's vocabulary",
        "prompt",
    )


def test_the_largest_int32_token_id_passes_the_parse() -> None:
    body = {"model": "m", "prompt": [0, 2**31 - 1]}
    assert parse_request(Api.COMPLETIONS, orjson.dumps(body), LIMIT).doc["prompt"] == body["prompt"]
