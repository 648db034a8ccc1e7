"""The most characters of input text one token can stand for, read off a tokenizer's definition.

It bounds a prompt from its length alone: a text of C characters needs at least C / bound tokens,
so a text longer than the context times the bound is refused before it is tokenized (megabytes of
text take seconds to tokenize). The bound must hold for every text, or a prompt that fits would be
refused, so it is given only where each step of the tokenizer provably keeps characters:

- the model is BPE and every character reaches a token of its own: byte fallback with all 256 byte
  tokens, a byte-level alphabet with all 256 symbols, or an unknown token that is never fused;
- no normalizer or pre-tokenizer removes characters, and the normalizers that merge them (NFC and
  NFKC: at most `MAX_COMPOSED_CHARS` into one; a Replace of a string by a shorter one) multiply it;
- no added token absorbs the whitespace beside it (`lstrip`, `rstrip`).

A token then covers at most as many characters as its own text has UTF-8 bytes: a byte-level
symbol stands for one byte (its text has one or two), a SentencePiece piece for its characters, a
byte-fallback token (`<0x41>`) for part of one. So the bound is the longest token's UTF-8 length
times the normalizers' merge factor: generous (often twice the truth), never too small. Anything
else (WordPiece, Unigram, Strip, StripAccents, BERT cleaning, whitespace-removing pre-tokenizers,
fused unknowns, regex replacements) gets no bound, and its prompts are only counted after tokenizing.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

# The longest canonical decomposition of one code point (U+1F82 GREEK SMALL LETTER ALPHA WITH PSILI
# AND VARIA AND YPOGEGRAMMENI is 4 code points): NFC and NFKC compose at most this many into one.
MAX_COMPOSED_CHARS = 4
# Normalizers whose output has at least as many characters as their input.
_LENGTHENING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
# Pre-tokenizers that split text without dropping any of it (unless their behavior is "Removed").
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}
)
_BYTE_FALLBACK_TOKENS = tuple(f"<0x{byte:02X}>" for byte in range(256))

Spec = dict[str, Any]  # one part of tokenizer.json


def max_chars_per_token(backend: BackendTokenizer) -> int | None:
    """Most input characters one token of `backend` can cover; None where no bound holds."""
    spec: Spec = json.loads(backend.to_str())
    model, pre_tokenizer = spec["model"], spec.get("pre_tokenizer")
    added: list[Spec] = spec.get("added_tokens") or []
    merge = _normalizer_merge(spec.get("normalizer"))
    if merge is None or not _keeps_every_char(pre_tokenizer) or not _covers_every_char(model, pre_tokenizer):
        return None
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    texts = [*model["vocab"], *(token["content"] for token in added)]
    return merge * max(len(text.encode("utf-8")) for text in texts)


def _normalizer_merge(normalizer: Spec | None) -> int | None:
    """How many input characters the normalizer can turn into one (None: it can delete them)."""
    if normalizer is None:
        return 1
    kind = normalizer["type"]
    if kind == "Sequence":
        merges = [_normalizer_merge(part) for part in normalizer["normalizers"]]
        return None if None in merges else math.prod(m for m in merges if m is not None)
    if kind in _LENGTHENING_NORMALIZERS:
        return 1
    if kind in ("NFC", "NFKC"):
        return MAX_COMPOSED_CHARS
    if kind == "Replace":
        pattern, content = normalizer["pattern"].get("String"), normalizer["content"]
        if pattern is None or not content:  # a regex, or a deletion: any run can vanish
            return None
        return max(1, math.ceil(len(pattern) / len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled: they drop characters


def _keeps_every_char(pre_tokenizer: Spec | None) -> bool:
    """Whether the pre-tokenizer only splits (Whitespace, BERT's and delimiter splits drop characters)."""
    if pre_tokenizer is None:
        return True
    if pre_tokenizer["type"] == "Sequence":
        return all(_keeps_every_char(part) for part in pre_tokenizer["pretokenizers"])
    return pre_tokenizer["type"] in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _covers_every_char(model: Spec, pre_tokenizer: Spec | None) -> bool:
    """Whether every character ends in a token of its own: none dropped, no run fused into one."""
    if model["type"] != "BPE":
        return False
    vocab = model["vocab"]
    if model.get("byte_fallback") and all(token in vocab for token in _BYTE_FALLBACK_TOKENS):
        return True
    if _is_byte_level(pre_tokenizer) and all(
        symbol in vocab for symbol in pre_tokenizers.ByteLevel.alphabet()
    ):
        return True
    return model.get("unk_token") is not None and not model.get("fuse_unk")


def _is_byte_level(pre_tokenizer: Spec | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer["type"] == "Sequence":
        return any(_is_byte_level(part) for part in pre_tokenizer["pretokenizers"])
    return bool(pre_tokenizer["type"] == "ByteLevel")
