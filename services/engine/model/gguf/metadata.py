"""A GGUF file's key/value metadata, parsed: what the weight loader and the tokenizer builder both read."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

NO_TOKEN = 0xFFFFFFFF  # llama.cpp writes -1 as uint32 for "no such token"


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: GGUFReader) -> None:
        self.reader = reader
        self.arch = str(self.get("general.architecture", "llama"))

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` (scalars as Python values, arrays as lists), or `default`."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, e.g. `llama.block_count`."""
        return self.get(f"{self.arch}.{key}", default)

    def token_id(self, key: str) -> int | None:
        """A `tokenizer.ggml.*_token_id` value; None when absent or -1."""
        value = self.get(f"tokenizer.ggml.{key}")
        return None if value is None or int(value) == NO_TOKEN else int(value)
