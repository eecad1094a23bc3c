"""A request's token ids as vLLM computes them, from the model's own tokenizer files.

Completions: the prompt encoded with special tokens (a BOS, where the tokenizer's post-processor
adds one), as vLLM does by default. Chat: the messages rendered with the model's chat template
the way Hugging Face renders it (a sandboxed jinja environment with trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML), then
encoded without special tokens, since the template writes them (vLLM's `add_special_tokens`
default for chat). Content given as parts is joined with newlines, as vLLM passes it to a
template that expects a string; a part that is not text (an image) cannot be tokenized here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from extproc.kvcache.token_bound import chars_per_token

__all__ = ["ChatTemplateError", "RequestTokenizer", "TokenizerFilesError", "token_ids"]

_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class TokenizerFilesError(ValueError):
    """The tokenizer files are missing or unreadable; the message says which and how to fix it."""


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: no template, a template error, or content not text."""


class RequestTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._special_tokens = dict(special_tokens or {})
        self._template = (
            None if chat_template is None else _environment().from_string(chat_template)
        )

    @classmethod
    def from_path(
        cls, path: str | Path, chat_template: str | Path | None = None
    ) -> RequestTokenizer:
        """From a model folder (tokenizer.json, tokenizer_config.json, chat_template.jinja) or a
        tokenizer.json file; `chat_template` (a file) overrides the model's, as vLLM's flag does."""
        path = Path(path).expanduser()
        folder = path if path.is_dir() else path.parent
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises its own Exception for a bad or missing file
            raise TokenizerFilesError(
                f"cannot load the tokenizer from {tokenizer_file}: {exc}; give the model's "
                "folder or its tokenizer.json"
            ) from exc
        config = _read_json(folder / "tokenizer_config.json")
        template = (
            _read_text(Path(chat_template).expanduser())
            if chat_template is not None
            else _model_template(folder, config)
        )
        return cls(tokenizer, template, _special_tokens(config))

    @cached_property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer gives (its added tokens too)."""
        return max(self._tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @cached_property
    def longest_token(self) -> int:
        """The most characters one token of the vocabulary stands for."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @cached_property
    def chars_per_token(self) -> int | None:
        """The most characters of a text one token can stand for; None where the tokenizer's
        structure does not bound it (`extproc.kvcache.token_bound`)."""
        config = json.loads(self._tokenizer.to_str())
        return chars_per_token(config, self._tokenizer.get_vocab(with_added_tokens=True).keys())

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def completion(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)  # token ids go to the engine as they are
        return self.encode(prompt, add_special_tokens=True)

    def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        """`options` as `render_chat` takes them."""
        return self.encode(self.render_chat(messages, **options), add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise ChatTemplateError("the model has no chat template: give one")
        context = {
            **self._special_tokens,
            **(template_kwargs or {}),
            "messages": [_message(m) for m in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
        }
        try:
            text = self._template.render(context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
        if continue_final_message:  # the last message left open, as Hugging Face cuts it
            last = context["messages"][-1].get("content")
            if isinstance(last, str) and last.strip() and last.strip() in text:
                text = text[: text.rindex(last.strip()) + len(last.strip())]
        return text

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))


def token_ids(
    tokenizer: RequestTokenizer, chat: bool, doc: Mapping[str, Any], context: int | None
) -> list[int] | None:
    """The request's ids as vLLM computes them; None where they are more than `context` (the
    longest prompt any engine runs; None: unknown), which is then not worth tokenizing: the
    engines refuse it, so what they hold of it cannot matter. Each character of a text lands
    in one token, whose own text is at most the vocabulary's longest: a text longer than
    `context` times that is more tokens than `context` and is not even encoded. (A tokenizer
    that drops characters, whitespace for one, could fit it: it is then only routed without
    the cache, which is always correct.) Raises ChatTemplateError, TypeError or ValueError
    where the ids cannot be had."""
    if chat:
        kwargs = doc.get("chat_template_kwargs")
        tools = doc.get("tools")
        text = tokenizer.render_chat(
            doc.get("messages") or [],
            add_generation_prompt=doc.get("add_generation_prompt", True) is not False,
            continue_final_message=doc.get("continue_final_message") is True,
            tools=tools if isinstance(tools, list) else None,
            template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        )
    else:
        prompt = doc.get("prompt")
        if not isinstance(prompt, str):
            raise TypeError("only a string prompt is tokenized")
        text = prompt
    if context is not None and len(text) > context * tokenizer.longest_token:
        return None
    ids = tokenizer.encode(text, add_special_tokens=not chat)
    return None if context is not None and len(ids) > context else ids


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatTemplateError("only text content can be tokenized for the KV index")
            texts.append(str(part.get("text", "")))
        content = "\n".join(texts)
    return {**message, "content": content}


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class _GenerationBlock(Extension):
    """`{% generation %}…{% endgeneration %}`, which Hugging Face templates use to mark the
    assistant's tokens for training masks: it renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads it from the class

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _model_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return _read_text(jinja_file)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerFilesError(f"cannot read {path}: {exc}") from exc
    return value if isinstance(value, dict) else {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenizerFilesError(f"cannot read the chat template {path}: {exc}") from exc
