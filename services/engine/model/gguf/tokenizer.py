"""Rebuild a `tokenizers.Tokenizer` from the vocabulary embedded in a GGUF file.

Two vocab kinds are supported: "llama" (SentencePiece BPE with byte fallback, merges recovered
from the token scores) and "gpt2" (byte-level BPE with explicit merges).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from services.engine.model.config import UnsupportedModel
from services.engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # annotations only, as before (the gateway passes its own duck-typed reader)
    from services.engine.model.gguf.metadata import GGUFMetadata

logger = logging.getLogger(__name__)

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPIECE_SPACE = "\u2581"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_gguf_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    """The model's tokenizer, BOS/EOS ids and chat template from `tokenizer.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    types: list[int] = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    if kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types)
    elif kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
    else:
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported (llama, gpt2)")
    _add_special_tokens(backend, tokens, types)
    eos_ids = tuple(dict.fromkeys(i for k in ("eos", "eot", "eom") if (i := meta.token_id(f"{k}_token_id"))))
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return Tokenizer(
        backend,
        bos_token_id=meta.token_id("bos_token_id"),
        eos_token_ids=eos_ids,
        add_bos_by_default=bool(add_bos),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _sentencepiece_bpe(meta: GGUFMetadata, tokens: list[str], types: list[int]) -> BackendTokenizer:
    scores: list[float] = [float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = meta.token_id("unknown_token_id")
    bpe = models.BPE(
        vocab=vocab,
        merges=sentencepiece_merges(tokens, scores, types),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = BackendTokenizer(bpe)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    scheme = "first" if add_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_SPACE, prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # drop the space SentencePiece prepended
    backend.decoder = decoders.Sequence(steps)
    return backend


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocab: a pair merges as early as its result scores high."""
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, piece_id in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[piece_id], mergeable[left], mergeable[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _byte_level_bpe(meta: GGUFMetadata, tokens: list[str]) -> BackendTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=merges,
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str) -> Any:
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # GPT-2 splitting, with every digit on its own
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in ("default", "gpt2"):
        logger.warning("GGUF pre-tokenizer %r is not known; using GPT-2 byte-level splitting", pre)
    return byte_level


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    # control/unknown tokens are special (skipped when decoding); user-defined ones stay whole but print
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k in (CONTROL, UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == USER_DEFINED
    ]
    backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
