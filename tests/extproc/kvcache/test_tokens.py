"""Request token ids: completions with the tokenizer's special tokens, chat rendered with the
model's template as Hugging Face renders it, then encoded without them."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from extproc.kvcache.tokens import (
    ChatTemplateError,
    RequestTokenizer,
    TokenizerFilesError,
)

TEMPLATE = """{{ bos_token }}
{% for m in messages %}
  {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
  {% if loop.index > 9 %}{% break %}{% endif %}
<{{ m['role'] }}>{% generation %}{{ m['content'] }}{% endgeneration %}

  {% if m.meta is defined %}
{{ m.meta | tojson }}
  {% endif %}
{% endfor %}
  {% if add_generation_prompt %}
<assistant>
  {% endif %}
"""


def _write_model(folder: Path, template: str | None = TEMPLATE, in_config: bool = False) -> Path:
    words = [
        "<s>",
        "</s>",
        "<unk>",
        "hello",
        "world",
        "<user>",
        "<assistant>",
        "<system>",
        "a",
        "b",
        '{"x":',
        '"<&>"}',
    ]  # split at whitespace: "<system>a" is one unknown word
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if template is not None and in_config:
        config["chat_template"] = [{"name": "default", "template": template}]
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_completion_gets_the_tokenizers_special_tokens(tmp_path: Path) -> None:
    tok = RequestTokenizer.from_path(_write_model(tmp_path))
    assert tok.completion("hello world") == [0, 3, 4]
    assert tok.completion([5, 6, 7]) == [5, 6, 7]  # token ids go as they are


def test_chat_renders_like_hugging_face_and_adds_no_second_bos(tmp_path: Path) -> None:
    tok = RequestTokenizer.from_path(_write_model(tmp_path))
    messages = [
        {"role": "system", "content": "a"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
            "meta": {"x": "<&>"},
        },
    ]
    # trim_blocks and lstrip_blocks drop the template's own indentation and newlines;
    # tojson does not escape HTML; text parts are joined with a newline
    assert tok.render_chat(messages) == (
        '<s>\n<system>a\n<user>hello\nworld\n{"x": "<&>"}\n<assistant>\n'
    )
    assert tok.chat(messages) == [0, 2, 2, 4, 10, 11, 6]  # one BOS: the template's
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("}\n")


def test_the_template_may_come_from_tokenizer_config(tmp_path: Path) -> None:
    tok = RequestTokenizer.from_path(_write_model(tmp_path, in_config=True) / "tokenizer.json")
    assert tok.chat([{"role": "user", "content": "b"}]) == [0, 2, 6]


def test_template_errors_and_non_text_content_are_chat_template_errors(tmp_path: Path) -> None:
    tok = RequestTokenizer.from_path(_write_model(tmp_path))
    with pytest.raises(ChatTemplateError, match="no tools here"):
        tok.chat([{"role": "tool", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="only text"):
        tok.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_the_sandbox_refuses_what_a_template_must_not_do(tmp_path: Path) -> None:
    evil = "{{ messages.__class__.__mro__ }}{% set _ = messages.append(1) %}"
    tok = RequestTokenizer.from_path(_write_model(tmp_path, template=evil))
    with pytest.raises(ChatTemplateError):
        tok.render_chat([{"role": "user", "content": "a"}])


def test_a_model_without_template_cannot_render_chat(tmp_path: Path) -> None:
    tok = RequestTokenizer.from_path(_write_model(tmp_path, template=None))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.chat([{"role": "user", "content": "a"}])


def test_missing_tokenizer_files_say_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match="give the model's folder"):
        RequestTokenizer.from_path(tmp_path)


def test_tojson_and_strftime_now_behave_as_in_hugging_faces_templates(tmp_path: Path) -> None:
    template = (
        "{{ messages[0] | tojson }}|{{ {'b': 1, 'a': 'é'} | tojson(indent=2, sort_keys=True) }}"
        "|{{ [1, 2] | tojson(separators=(',', ':')) }}|{{ strftime_now('%Y') }}"
        "|{{ 'é' | tojson(ensure_ascii=True) }}"
    )
    tok = RequestTokenizer.from_path(_write_model(tmp_path, template))
    text = tok.render_chat([{"role": "user", "content": "é"}])
    year = str(datetime.now().year)
    # not ASCII-escaped, keys in their order unless sorted
    assert text.split("|") == [
        '{"role": "user", "content": "é"}',
        '{\n  "a": "é",\n  "b": 1\n}',
        "[1,2]",
        year,
        '"\\u00e9"',
    ]


def test_chat_hands_its_options_to_the_template(tmp_path: Path) -> None:
    tok = RequestTokenizer.from_path(_write_model(tmp_path))
    messages = [{"role": "user", "content": "hello"}]
    opened = tok.chat(messages)
    closed = tok.chat(messages, add_generation_prompt=False)
    assert opened == [*closed, 6]  # <assistant> only where the generation prompt is asked
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"


def test_an_unreadable_chat_template_says_which(tmp_path: Path) -> None:
    model = _write_model(tmp_path)
    with pytest.raises(TokenizerFilesError, match=r"cannot read the chat template .*nowhere"):
        RequestTokenizer.from_path(model, tmp_path / "nowhere.jinja")
