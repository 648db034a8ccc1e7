"""Incremental detokenization: turn one new token id at a time into the text it adds."""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Prompt tokens kept as left context, so a completion's first token keeps its leading space and
# byte-fallback / byte-level pieces of one character are decoded together.
CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Streams text deltas whose concatenation equals decode(prompt + completion) minus decode(prompt).

    It decodes a short sliding window twice per token (with and without the newest tokens) and emits
    the difference, holding text back while it ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, decode: DecodeFn, prompt_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_offset = self._clean_start()

    def _clean_start(self) -> int:
        # A window that starts mid-character decodes to U+FFFD, and byte-fallback decoders then spoil
        # the whole byte run; start at the first token after which the context decodes cleanly.
        start = 0
        while start < self._read_offset and self._decode(self._ids[start : self._read_offset]).startswith(
            REPLACEMENT_CHAR
        ):
            start += 1
        return start

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (often "", e.g. mid-character)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any held-back text (an incomplete character at the end of generation)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
