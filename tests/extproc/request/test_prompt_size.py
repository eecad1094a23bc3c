"""What of a request counts toward its prompt's size (the decode-only decision)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from extproc.request.parse import Api, parse_request
from extproc.request.prompt_size import TOKENIZED, prompt_bytes

TINY = [{"role": "user", "content": "hi"}]
BIG = "x" * 10_000


def size(body: dict[str, Any], api: Api = Api.CHAT, **kwargs: Any) -> int | None:
    request = parse_request(api, orjson.dumps({"model": "m", **body}), 1 << 24)
    return prompt_bytes(request, **kwargs)


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "description": BIG}}]},
        {"documents": [{"title": "t", "text": BIG}]},
        {"chat_template_kwargs": {"context": BIG}},
        {"response_format": {"type": "json_schema", "json_schema": {"description": BIG}}},
        {"an_unknown_field": BIG},  # unknown: counted, erring toward disaggregation
    ],
)
def test_every_member_that_may_reach_the_prompt_counts(extra: dict[str, Any]) -> None:
    alone = size({"messages": TINY})
    assert alone is not None and alone < 100
    with_extra = size({"messages": TINY, **extra})
    assert with_extra is not None and with_extra > len(BIG)


def test_a_completions_prompt_embeds_count() -> None:
    measured = size({"prompt": "hi", "prompt_embeds": BIG}, Api.COMPLETIONS)
    assert measured is not None and measured > len(BIG)


def test_sampling_and_output_controls_do_not_count() -> None:
    controls = {
        "max_tokens": 5,
        "temperature": 0.5,
        "stop": ["\n"] * 500,
        "logit_bias": {str(i): 1 for i in range(500)},
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"x": BIG},
    }
    assert size({"messages": TINY, **controls}) == size({"messages": TINY})


@pytest.mark.parametrize(
    "extra",
    [
        {"chat_template": "{{ messages[0].content }}"},  # a loop renders any length
        {"mm_processor_kwargs": {"max_pixels": 1 << 30}},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                }
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]},
    ],
)
def test_a_prompt_the_body_cannot_bound_has_no_size(extra: dict[str, Any]) -> None:
    assert size({"messages": TINY} | extra) is None


def test_text_parts_are_bounded() -> None:
    assert size({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]})


def test_what_the_tokenizer_counted_is_not_counted_again() -> None:
    body = {"messages": TINY, "tools": [{"type": "function"}], "documents": [{"text": BIG}]}
    rest = size(body, counted=TOKENIZED[Api.CHAT])
    assert rest is not None and len(BIG) < rest < len(BIG) + 100  # only the documents
    assert size({"prompt": "hi"}, Api.COMPLETIONS, counted=TOKENIZED[Api.COMPLETIONS]) == 0
