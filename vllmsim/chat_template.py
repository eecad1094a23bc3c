"""Chat prompts rendered with the model's chat template, as vLLM renders them (through Hugging
Face's jinja2 set-up): a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, `raise_exception` and `strftime_now` globals, a `tojson` filter that
does not escape HTML, the tokenizer's special tokens as variables, and
`add_generation_prompt` true unless the request says otherwise. The rendered text is then
tokenized without adding special tokens again (the template writes them), vLLM's default.

The template comes from the tokenizer folder: chat_template.jinja, else tokenizer_config.json's
`chat_template` (a string, or a list of named templates of which "default" is used).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any


class ChatTemplateError(Exception):
    """The template failed for this request (vLLM answers 400 with the message)."""


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in (
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
    ):
        value = config.get(name)
        if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _template_text(folder: Path, config: dict[str, Any]) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._errors = (jinja2.exceptions.TemplateError,)
        self._template = env.from_string(source)
        self._special = special_tokens

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTemplate | None:
        """The folder's chat template, or None when it has none."""
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            raw = json.loads((folder / "tokenizer_config.json").read_text())
            config = raw if isinstance(raw, dict) else {}
        text = _template_text(folder, config)
        return cls(text, _special_tokens(config)) if text is not None else None

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        variables = {
            **(extra or {}),
            **self._special,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
        }
        try:
            return str(self._template.render(**variables))
        except self._errors as exc:
            raise ChatTemplateError(str(exc)) from exc


def text_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with OpenAI content parts flattened to text (vLLM's "string" content format:
    text parts joined by newlines)."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            texts = [
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type", "text") == "text"
            ]
            msg = {**msg, "content": "\n".join(texts)}
        out.append(msg)
    return out
