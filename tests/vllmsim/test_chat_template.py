"""Prompts tokenized as vLLM does: completions with the tokenizer's special tokens, chat
rendered with the model's template (Hugging Face's jinja2 settings) and tokenized without
adding them again; the prefix cache then works on the ids vLLM would hash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tokenizers import Tokenizer

from scripts.cached_envs import CACHE_DIR
from tests.vllmsim.vsim_helpers import post
from vllmsim.launcher import FAST, EngineHandle, running_engine

TINY = CACHE_DIR / "tiny-llama"
pytestmark = pytest.mark.skipif(
    not (TINY / "tokenizer.json").is_file(),
    reason=f"no tiny model at {TINY} (python scripts/cached_envs.py model)",
)

# Block tags on their own indented lines: trim_blocks and lstrip_blocks leave no trace of them.
TEMPLATE = """{{ "<b>é" | tojson }}
{% for m in messages %}
  {% if m['role'] == 'tool' %}
    {{ raise_exception('tool messages are not supported') }}
  {% endif %}
<|{{ m['role'] }}|>{{ m['content'] }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
SYSTEM = {"role": "system", "content": "You answer in one word, always, whatever is asked. " * 4}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})
    )
    return tmp_path


async def tokenize(http: aiohttp.ClientSession, eng: EngineHandle, body: dict[str, Any]) -> Any:
    async with http.post(eng.url + "/tokenize", json=body) as resp:
        return resp.status, await resp.json()


async def test_chat_is_rendered_with_the_models_template(
    http: aiohttp.ClientSession, model_dir: Path
) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    async with running_engine(*FAST, "--tokenizer", str(model_dir)) as eng:
        user = {
            "role": "user",
            "content": [{"type": "text", "text": "Why"}, {"type": "text", "text": "not?"}],
        }
        status, got = await tokenize(http, eng, {"messages": [SYSTEM, user]})
        text = f'"<b>é"\n<|system|>{SYSTEM["content"]}\n<|user|>Why\nnot?\n<|assistant|>\n'
        assert status == 200
        assert got["tokens"] == tok.encode(text, add_special_tokens=False).ids
        status, got = await tokenize(
            http, eng, {"messages": [SYSTEM], "add_generation_prompt": False}
        )
        assert (
            got["tokens"]
            == tok.encode(f'"<b>é"\n<|system|>{SYSTEM["content"]}\n', add_special_tokens=False).ids
        )
        # completions keep the tokenizer's special tokens (a BOS for this one)
        status, body = await post(
            http, eng, "/v1/completions", {"prompt": "Hello there", "max_tokens": 1}
        )
        assert body["usage"]["prompt_tokens"] == len(tok.encode("Hello there").ids)
        status, err = await post(
            http, eng, "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}
        )
        assert status == 400 and err["error"]["message"] == "tool messages are not supported"


async def test_a_shared_system_prompt_is_cached(
    http: aiohttp.ClientSession, model_dir: Path
) -> None:
    async with running_engine(
        *FAST, "--tokenizer", str(model_dir), "--enable-prompt-tokens-details"
    ) as eng:
        usages = []
        for question in ("What is up?", "Where is the sun?"):
            status, body = await post(
                http,
                eng,
                "/v1/chat/completions",
                {"messages": [SYSTEM, {"role": "user", "content": question}], "max_tokens": 1},
            )
            assert status == 200, body
            usages.append(body["usage"])
        prefix = len(
            (await tokenize(http, eng, {"messages": [SYSTEM], "add_generation_prompt": False}))[1][
                "tokens"
            ]
        )
        assert usages[0]["prompt_tokens_details"] is None
        # the whole blocks of the shared system prompt (and maybe of the user header)
        cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
        assert cached % 16 == 0 and prefix - 16 < cached <= usages[1]["prompt_tokens"] - 1


async def test_the_model_folder_gives_the_tokenizer(
    http: aiohttp.ClientSession, model_dir: Path
) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    async with running_engine(*FAST, str(model_dir)) as eng:
        status, body = await post(
            http,
            eng,
            "/v1/completions",
            {"model": str(model_dir), "prompt": "Hello there friend", "max_tokens": 1},
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(tok.encode("Hello there friend").ids)
