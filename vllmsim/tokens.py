"""Token counting and deterministic output text.

With ``--tokenizer PATH`` prompts are counted with the Hugging Face ``tokenizers``
library (PATH/tokenizer.json), so ``usage.prompt_tokens`` matches what ``vllm bench
serve`` generated, and chat prompts are rendered with the folder's chat template
(chat_template.py): the prefix cache then hashes the ids vLLM would. Without it the count
is an approximation: one BOS token plus one token per word or punctuation mark, with words
longer than 6 characters counted as one token per started 6 characters; the pseudo ids are
deterministic, so identical prefixes still share cached blocks. Token-id prompts are always
counted exactly.

Output tokens are drawn from a fixed word list by hashing (what the prompt's KV blocks
hold, token index): see kv_content.py. A disaggregated answer is byte-identical to an
aggregated one only when the KV that reached the decode engine is right.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from vllmsim.chat_template import ChatTemplate, text_content

_PIECE_RE = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_WORD_TEXT = (
    "the of and to in is that it for on with as was at by this be from or are an "
    "which not but have one all were they can when there been has more will if no "
    "out so what up time into some could them other than then now only its over new "
    "also two may first any these way well made most after where before through back"
)
_WORDS = tuple(_WORD_TEXT.split())
_APPROX_VOCAB = 32000


class TokenCounter:
    """Counts prompt tokens and renders output tokens; one instance per engine."""

    def __init__(self, tokenizer_dir: str | None = None) -> None:
        self._tok: Any = None
        self.template: ChatTemplate | None = None
        self._output_ids: dict[str, list[int]] = {}
        if tokenizer_dir:
            from tokenizers import Tokenizer  # imported lazily: keeps start-up fast

            path = Path(tokenizer_dir)
            self._tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
            if path.is_dir():
                self.template = ChatTemplate.from_folder(path)

    def chat_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """A chat prompt's token ids: with the model's template as vLLM renders it, tokenized
        without special tokens (the template writes them); without one, the stand-in below
        (role headers, a BOS)."""
        if self.template is None:
            return self.encode(chat_prompt_text(messages))
        text = self.template.render(text_content(messages), add_generation_prompt, template_kwargs)
        return self.encode(text, add_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tok is not None:
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        ids = [1] if add_special_tokens else []  # a BOS, as most HF tokenizers add
        # Split on whitespace first (same pieces: none spans or holds whitespace); the regex
        # alone scans a long run of whitespace at ~85 ns a character.
        for piece in (p for word in text.split() for p in _PIECE_RE.findall(word)):
            for start in range(0, len(piece), 6):
                digest = hashlib.blake2b(piece[start : start + 6].encode(), digest_size=4)
                ids.append(2 + int.from_bytes(digest.digest(), "big") % (_APPROX_VOCAB - 2))
        return ids

    def output_ids(self, text: str) -> list[int]:
        """The ids of one output token's text (memoised: the texts come from a small list)."""
        ids = self._output_ids.get(text)
        if ids is None:
            ids = self._output_ids[text] = self.encode(text, add_special_tokens=False)
        return ids

    def decode(self, ids: list[int]) -> str:
        if self._tok is not None:
            return str(self._tok.decode(ids))
        return "".join(" " + _WORDS[i % len(_WORDS)] for i in ids)

    def count(self, text: str) -> int:
        return len(self.encode(text))


def output_token(context: bytes, index: int) -> str:
    """The text of output token `index` after a prompt whose KV reads as `context`."""
    digest = hashlib.blake2b(context + index.to_bytes(4, "big"), digest_size=4).digest()
    return " " + _WORDS[int.from_bytes(digest, "big") % len(_WORDS)]


def chat_prompt_text(messages: list[dict[str, Any]]) -> str:
    """A stand-in for the chat template: role headers around each message's text."""
    parts = []
    for msg in messages:
        content = msg.get("content", "")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{msg.get('role', 'user')}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)
