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


class UnknownIntentClass(InvalidPrompt):
    """A request named an intent class this engine does not know."""

    def __init__(self, name: str, known: list[str]) -> None:
        shown = repr(name) if len(name) <= 64 else f"{name[:64]!r}..."
        super().__init__(f"unknown intent_class {shown}; known classes: {', '.join(known)}")


class UnknownRetrievalMode(InvalidPrompt):
    """A request (or an intent class) named a retrieval mode this engine does not know."""

    def __init__(self, mode: str, known: list[str]) -> None:
        super().__init__(
            f"unknown retrieval mode {mode[:40]!r} (x-retrieval-mode); known modes: {', '.join(known)}"
        )


class KVCapacityExceeded(RuntimeError):
    """A request that cannot fit the KV tiers under the `refuse` policy (RESOURCE_EXHAUSTED)."""

    def __init__(self, num_tokens: int, max_tokens: int, holder: str | None = None) -> None:
        holder = holder or (
            f"this engine's KV tiers hold {max_tokens} tokens per request (sink + hot + warm, refuse "
            f"policy); ask for at most {max_tokens} tokens in total, or use an intent class with a larger "
            "warm tier"
        )
        super().__init__(f"prompt plus max_tokens is {num_tokens} tokens but {holder}")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class KVPoolTooSmall(KVCapacityExceeded):
    """A request whose tokens need more hot KV than the whole pool holds (RESOURCE_EXHAUSTED)."""

    def __init__(self, num_tokens: int, pool_tokens: int) -> None:
        super().__init__(
            num_tokens,
            pool_tokens,
            f"this engine's hot KV pool holds {pool_tokens} tokens in all, so the request could never run; "
            f"ask for at most {pool_tokens} tokens in total, or send it to a replica with a larger KV cache",
        )
