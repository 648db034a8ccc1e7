"""The characters-per-token bound: it holds on hard texts, multiplies with merging normalizers, and is
withheld wherever characters can vanish or a run of them can become one token."""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

from services.engine.text.chars_per_token import MAX_COMPOSED_CHARS, max_chars_per_token
from services.engine.text.tokenizer import Tokenizer as EngineTokenizer
from tests.engine.tiny_llama import build_tokenizer

HARD_TEXTS = (
    " " * 300,
    "\u2581" * 200,  # SentencePiece's space marker, typed by the caller
    "a" * 500,
    "e\u0301\u0302\u0303" * 50,  # combining marks
    "\u1100\u1161\u11a8" * 60,  # Hangul jamo that NFC composes three to one
    "\U0001f600\u4e2d\u0000\u200d" * 40,  # emoji, CJK, NUL, joiner
    "<s></s><unk>" * 30,  # the special tokens' own text
)


def _random_text(generator: random.Random) -> str:
    alphabet = "abc xyz.,'\n\t\u00e9\u0301\u4e2d\U0001f600\u2581"
    return "".join(generator.choice(alphabet) for _ in range(generator.randrange(1, 400)))


def _bpe(
    normalizer: normalizers.Normalizer | None = None, pre: pre_tokenizers.PreTokenizer | None = None
) -> Tokenizer:
    """A byte-level BPE whose bound holds, changed in one part."""
    tokenizer = build_tokenizer(300)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre is not None:
        tokenizer.pre_tokenizer = pre
    return tokenizer


def test_stories260k_bound_is_its_longest_token_and_holds_on_hard_texts(stories_hf_dir: Path) -> None:
    tokenizer = EngineTokenizer.from_hf_dir(stories_hf_dir)
    bound = tokenizer.max_chars_per_token
    assert bound == max(len(token.encode()) for token in tokenizer.backend.get_vocab()) == 9
    generator = random.Random(0)
    for text in [*HARD_TEXTS, *(_random_text(generator) for _ in range(200))]:
        assert len(text) <= bound * len(tokenizer.encode(text)), text


def test_byte_level_bound_holds_on_hard_texts() -> None:
    tokenizer = build_tokenizer(300)
    bound = max_chars_per_token(tokenizer)
    assert bound is not None
    generator = random.Random(1)
    for text in [*HARD_TEXTS, *(_random_text(generator) for _ in range(200))]:
        assert len(text) <= bound * len(tokenizer.encode(text).ids), text


def test_merging_normalizers_multiply_the_bound() -> None:
    plain = max_chars_per_token(_bpe())
    assert plain is not None
    nfc = normalizers.Sequence([normalizers.NFC(), normalizers.Replace("  ", " ")])
    assert max_chars_per_token(_bpe(nfc)) == plain * MAX_COMPOSED_CHARS * 2
    assert (
        max_chars_per_token(_bpe(normalizers.Sequence([normalizers.Lowercase(), normalizers.NFD()]))) == plain
    )


def test_the_composition_factor_is_the_longest_canonical_decomposition() -> None:
    longest = max(len(unicodedata.normalize("NFD", chr(code))) for code in range(0x110000))
    assert longest == MAX_COMPOSED_CHARS


NO_BOUND = {
    "strip": _bpe(normalizers.Strip()),
    "strip-accents": _bpe(normalizers.StripAccents()),
    "regex-replace": _bpe(normalizers.Replace(Regex(" +"), " ")),
    "deleting-replace": _bpe(normalizers.Replace(" ", "")),
    "whitespace": _bpe(pre=pre_tokenizers.Whitespace()),
    "split-removed": _bpe(pre=pre_tokenizers.Split(" ", behavior="removed")),
    "fused-unknowns": Tokenizer(
        models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True)
    ),
    "no-unknown": Tokenizer(models.BPE(vocab={"a": 0}, merges=[])),  # unknown characters are dropped
    "wordpiece": Tokenizer(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
}


@pytest.mark.parametrize("name", sorted(NO_BOUND))
def test_no_bound_where_characters_can_vanish_or_fuse(name: str) -> None:
    assert max_chars_per_token(NO_BOUND[name]) is None


def test_no_bound_when_an_added_token_absorbs_whitespace() -> None:
    tokenizer = _bpe()
    tokenizer.add_special_tokens([AddedToken("<mask>", rstrip=True)])
    assert max_chars_per_token(tokenizer) is None
    assert len(tokenizer.encode("<mask>" + " " * 100).ids) == 1  # why: 106 characters, one token
