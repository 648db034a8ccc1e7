"""Errors the engine raises to its callers; each message says what to change."""

from __future__ import annotations


class InvalidPrompt(ValueError):
    """A prompt the engine cannot run."""


class EmptyPrompt(InvalidPrompt):
    """A prompt with no tokens."""


class PromptTooLong(InvalidPrompt):
    """A prompt that leaves no room for a new token within max_seq_len."""

    def __init__(self, num_tokens: int, max_seq_len: int) -> None:
        super().__init__(
            f"prompt has {num_tokens} tokens but the limit is {max_seq_len - 1} "
            f"(max_seq_len {max_seq_len}, one position kept for the first new token); shorten the prompt"
        )
        self.num_tokens = num_tokens
        self.max_seq_len = max_seq_len


class EngineStopped(RuntimeError):
    """A request was submitted to an engine that has been stopped."""
