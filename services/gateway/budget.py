"""Token budgets: the prompt counted with the model's own tokenizer, checked against the limits.

The gateway loads the served model's tokenizer (an HF directory with tokenizer.json, or the
vocabulary inside a .gguf file) and counts exactly what the engine will: the prompt with BOS,
or the chat rendered by the model's template. It reuses the engine's tokenizer module (pure
`tokenizers` + jinja2, no torch) rather than a second copy of the GGUF vocabulary rebuild.
Without a configured tokenizer the count falls back to the prompt's UTF-8 byte length, an upper
bound for byte-level and byte-fallback BPE vocabularies.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from services.common.errors import InvalidArgument
from services.gateway.tenants import TenantLimits
from thermocline.gateway.v1 import gateway_pb2 as pb

log = logging.getLogger(__name__)


class PromptCounter(Protocol):
    """Counts the prompt tokens of a request."""

    name: str

    def count(self, request: pb.GenerateRequest) -> int:
        """The number of prompt tokens the engine will see."""
        ...


class ByteCounter:
    """The fallback: UTF-8 bytes, an upper bound on BPE tokens of byte-level vocabularies."""

    name = "utf-8 bytes (no tokenizer configured)"

    def count(self, request: pb.GenerateRequest) -> int:
        """Bytes of the prompt, or of every chat turn's content."""
        if request.WhichOneof("input") == "chat":
            return sum(len(m.content.encode()) + len(m.role.encode()) for m in request.chat.messages)
        return len(request.prompt.encode())


class _GGUFFields:
    """The slice of a GGUF reader that the engine's vocabulary rebuild reads."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default`."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def token_id(self, key: str) -> int | None:
        """A `tokenizer.ggml.*_token_id` value; None when absent or -1."""
        value = self.get(f"tokenizer.ggml.{key}")
        return None if value is None or int(value) == -1 else int(value)


class TokenizerCounter:
    """Counts with the served model's tokenizer."""

    def __init__(self, path: Path) -> None:
        self.name = f"the tokenizer of {path.parent.name}/{path.name}"
        self._tokenizer = _load(path)

    def count(self, request: pb.GenerateRequest) -> int:
        """Prompt tokens as the engine counts them."""
        tokenizer = self._tokenizer
        if request.WhichOneof("input") != "chat":
            return len(tokenizer.encode(request.prompt))
        if tokenizer.chat_template is None:
            raise InvalidArgument("this model has no chat template; send a plain prompt instead")
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        try:
            text = tokenizer.apply_chat_template(messages)
        except ValueError as error:
            raise InvalidArgument(f"chat template rejected the messages: {error}") from None
        return len(tokenizer.encode(text, add_bos=False))


def _load(path: Path) -> Any:
    from services.engine.text.tokenizer import Tokenizer

    if path.suffix == ".gguf":
        from services.engine.model.gguf.tokenizer import build_gguf_tokenizer

        return build_gguf_tokenizer(_GGUFFields(path))  # type: ignore[arg-type]
    directory = path.parent if path.name == "tokenizer.json" else path
    return Tokenizer.from_hf_dir(directory)


def load_counter(path: Path | None) -> PromptCounter:
    """The model's tokenizer when configured, else the byte-count upper bound."""
    if path is None:
        log.warning("THERMOCLINE_GATEWAY_TOKENIZER is unset; prompts are counted as UTF-8 bytes")
        return ByteCounter()
    return TokenizerCounter(path)


def check_request_budget(
    tenant: str, limits: TenantLimits, prompt_tokens: int, max_tokens: int, counted_by: str
) -> None:
    """INVALID_ARGUMENT with both counts when one request asks for more than its tenant allows."""
    asked = prompt_tokens + max_tokens
    if asked > limits.max_request_tokens:
        raise InvalidArgument(
            f"request exceeds its token budget: {prompt_tokens} prompt tokens (counted with {counted_by}) + "
            f"{max_tokens} max_tokens = {asked}, but tenant {tenant!r} allows {limits.max_request_tokens} "
            "per request; shorten the prompt or lower max_tokens"
        )
    if prompt_tokens > limits.token_capacity:
        raise InvalidArgument(
            f"prompt of {prompt_tokens} tokens exceeds tenant {tenant!r}'s token bucket of "
            f"{limits.token_capacity} tokens ({limits.tokens_per_min} tokens/min); it can never be admitted"
        )
