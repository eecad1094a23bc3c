"""The most characters of a text one token can stand for, from a tokenizer's structure.

A text of `n` characters is then at least `n / chars_per_token` tokens, without encoding it:
what lets a prompt longer than every engine's context be refused before it is tokenized. The
bound holds only where the tokenizer keeps every character: each lands in a token whose own
text is at most the vocabulary's longest. Many do not: a normalizer may compose or delete
characters, a pre-tokenizer may drop whitespace, a word-level or word-piece model turns a whole
unknown word into one token, a BPE that fuses unknown characters makes a run of them one token.
Only the structures known to keep them, or to shrink a text by a known factor, give a bound;
any other gives None (no bound: nothing is refused on it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from tokenizers import pre_tokenizers

__all__ = ["chars_per_token"]

# The longest canonical (NFD) and compatibility (NFKD) decomposition of one character: NFC and
# NFKC compose at most that many characters into one (len(x) <= len(NFD(x)) = len(NFD(NFC(x)))
# <= 4 * len(NFC(x))). Checked against `unicodedata` by the tests.
_COMPOSED = {"NFC": 4, "NFKC": 18}
_KEEPING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})
_KEEPING_BEHAVIOURS = frozenset({"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"})


def chars_per_token(config: Mapping[str, Any], vocabulary: Collection[str]) -> int | None:
    """The most characters one token can stand for in a tokenizer (its `tokenizer.json`,
    decoded; `vocabulary`: its tokens' texts, added tokens too); None where its structure
    does not bound it."""
    shrink = _normalizer_shrink(config.get("normalizer"))
    pre = config.get("pre_tokenizer")
    model = config.get("model")
    if shrink is None or not _keeps_characters(pre) or not _model_keeps(model, pre, vocabulary):
        return None
    return max(map(len, vocabulary), default=1) * shrink


def _normalizer_shrink(normalizer: Mapping[str, Any] | None) -> int | None:
    """How many characters of a text the normalizer can make into one; None: unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for each in normalizer.get("normalizers") or []:
            step = _normalizer_shrink(each)
            if step is None:
                return None
            factor *= step
        return factor
    if kind in _COMPOSED:
        return _COMPOSED[kind]
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content")
        literal = pattern.get("String")
        if not isinstance(literal, str) or not literal or not isinstance(content, str):
            return None  # a regex, or a replacement by nothing
        if not content:
            return None
        return -(-len(literal) // len(content))
    return None


def _keeps_characters(pre: Mapping[str, Any] | None) -> bool:
    """The pre-tokenizer drops no character (whitespace splitting does)."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(each) for each in pre.get("pretokenizers") or [])
    if kind in _KEEPING_PRE_TOKENIZERS:
        return True
    if kind == "Split":
        return pre.get("behavior") in _KEEPING_BEHAVIOURS and pre.get("invert") is False
    if kind == "Punctuation":
        return pre.get("behavior", "Isolated") in _KEEPING_BEHAVIOURS
    return False


def _has_byte_level(pre: Mapping[str, Any] | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_has_byte_level(each) for each in pre.get("pretokenizers") or [])
    return pre.get("type") == "ByteLevel"


def _model_keeps(
    model: Mapping[str, Any] | None, pre: Mapping[str, Any] | None, vocabulary: Collection[str]
) -> bool:
    """A BPE whose every character lands in a token: byte-level with every byte in the
    vocabulary, byte fallback, or unknown characters each a token of their own. Word-level,
    word-piece and unigram models can make a run of characters one unknown token."""
    if model is None or model.get("type") != "BPE" or model.get("dropout") not in (None, 0):
        return False
    if model.get("byte_fallback") is True:
        return True
    if _has_byte_level(pre):
        return set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocabulary)
    return model.get("unk_token") is not None and model.get("fuse_unk") is not True
