"""Which tokenizer structures bound the characters one token stands for, and by how much."""

from __future__ import annotations

import json
import sys
import unicodedata
from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from extproc.kvcache import token_bound
from extproc.kvcache.token_bound import chars_per_token

BYTES = pre_tokenizers.ByteLevel.alphabet()


def byte_level(**model: Any) -> Tokenizer:
    vocab = {c: i for i, c in enumerate([*BYTES, "abcdef"])}
    tokenizer = Tokenizer(models.BPE(vocab, [], **model))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    return tokenizer


def bound(tokenizer: Tokenizer) -> int | None:
    config = json.loads(tokenizer.to_str())
    return chars_per_token(config, tokenizer.get_vocab(with_added_tokens=True).keys())


def test_a_byte_level_bpe_is_bounded_by_its_longest_token() -> None:
    tokenizer = byte_level()
    assert bound(tokenizer) == 6
    tokenizer.add_special_tokens(["<|a-long-special-token|>"])
    assert bound(tokenizer) == len("<|a-long-special-token|>")


def test_a_byte_level_bpe_missing_a_byte_is_not_bounded() -> None:
    vocab = {c: i for i, c in enumerate(BYTES[1:])}  # an unknown byte would vanish
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert bound(tokenizer) is None


@pytest.mark.parametrize(
    ("normalizer", "factor"),
    [
        (normalizers.NFD(), 1),
        (normalizers.Lowercase(), 1),
        (normalizers.Sequence([normalizers.Prepend("_"), normalizers.Replace(" ", "_")]), 1),
        (normalizers.Replace("  ", " "), 2),  # two spaces become one
        (normalizers.NFC(), 4),
        (normalizers.NFKC(), 18),
        (normalizers.Sequence([normalizers.NFC(), normalizers.Replace("ab", "c")]), 8),
        (normalizers.Replace("x", ""), None),  # deletes
        (normalizers.Strip(), None),
        (normalizers.BertNormalizer(), None),  # drops control characters
    ],
)
def test_a_normalizer_multiplies_the_bound_by_how_much_it_can_shrink_a_text(
    normalizer: normalizers.Normalizer, factor: int | None
) -> None:
    tokenizer = byte_level()
    tokenizer.normalizer = normalizer
    assert bound(tokenizer) == (None if factor is None else 6 * factor)


@pytest.mark.parametrize(
    ("pre", "bounded"),
    [
        (pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.ByteLevel()]), True),
        (
            pre_tokenizers.Sequence(
                [pre_tokenizers.Split(" ", "isolated"), pre_tokenizers.ByteLevel()]
            ),
            True,
        ),
        (
            pre_tokenizers.Sequence(
                [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.ByteLevel()]
            ),
            False,
        ),
        (
            pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()]),
            False,
        ),
    ],
)
def test_a_pre_tokenizer_that_drops_characters_gives_no_bound(
    pre: pre_tokenizers.PreTokenizer, bounded: bool
) -> None:
    tokenizer = byte_level()
    tokenizer.pre_tokenizer = pre
    assert (bound(tokenizer) is not None) is bounded


def test_only_a_bpe_that_keeps_unknown_characters_apart_is_bounded() -> None:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}
    kept = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="<unk>"))
    assert bound(kept) == 5  # "<unk>" itself
    fused = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="<unk>", fuse_unk=True))
    assert bound(fused) is None  # a run of unknown characters is one token
    assert bound(Tokenizer(models.BPE(vocab, [("a", "b")], byte_fallback=True))) == 5
    assert bound(Tokenizer(models.BPE(vocab, [("a", "b")]))) is None  # unknowns vanish
    assert bound(Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))) is None
    assert bound(Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))) is None
    assert bound(Tokenizer(models.Unigram([("a", -1.0), ("<unk>", -2.0)], 1))) is None


def test_the_composition_factors_are_unicodes_longest_decompositions() -> None:
    """NFC (NFKC) makes at most as many characters into one as the longest canonical
    (compatibility) decomposition of a character has."""
    every = [chr(c) for c in range(sys.maxunicode + 1)]
    assert {
        "NFC": max(len(unicodedata.normalize("NFD", c)) for c in every),
        "NFKC": max(len(unicodedata.normalize("NFKD", c)) for c in every),
    } == token_bound._COMPOSED


def test_bpe_dropout_gives_no_bound_and_a_bare_byte_alphabet_one() -> None:
    assert bound(byte_level(dropout=0.1)) is None  # merges skipped at random
    assert bound(byte_level(dropout=0.0)) == 6
    alphabet_only = Tokenizer(models.BPE({c: i for i, c in enumerate(BYTES)}, []))
    alphabet_only.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert bound(alphabet_only) == 1  # every byte a token, nothing longer
