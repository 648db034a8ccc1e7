"""The engine's settings, read from `THERMOCLINE_ENGINE_*` variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.common import env
from services.common.config import ServerConfig

DEFAULT_PORT = 50052
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EngineConfig:
    """Which model the engine serves, where, and how many requests it decodes at once.

    `THERMOCLINE_ENGINE_MODEL`: a known model name (see services/engine/models.py), a Hugging Face
    checkpoint directory or a .gguf file. `_DEVICE` (auto, cpu, cuda, cuda:N), `_DTYPE` (auto,
    float32, bfloat16, float16), `_MAX_BATCH_SIZE`, `_MAX_SEQ_LEN` (0 = the model's own limit),
    `_DEFAULT_MAX_TOKENS` (used when a request gives none) and `_MAX_TOKENS_LIMIT` (the cap).
    """

    server: ServerConfig
    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int = 16
    max_seq_len: int = 0
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"THERMOCLINE_ENGINE_MAX_BATCH_SIZE must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len < 0:
            raise ValueError(f"THERMOCLINE_ENGINE_MAX_SEQ_LEN must be >= 0, got {self.max_seq_len}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"THERMOCLINE_ENGINE_DEFAULT_MAX_TOKENS ({self.default_max_tokens}) must lie in "
                f"1..THERMOCLINE_ENGINE_MAX_TOKENS_LIMIT ({self.max_tokens_limit})"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineConfig:
        """Reads the engine's settings."""
        prefix = "THERMOCLINE_ENGINE_"
        return cls(
            server=ServerConfig.from_env("engine", DEFAULT_PORT, environ),
            model=env.get_str(prefix + "MODEL", DEFAULT_MODEL, environ),
            device=env.get_str(prefix + "DEVICE", "auto", environ),
            dtype=env.get_str(prefix + "DTYPE", "auto", environ),
            max_batch_size=env.get_int(prefix + "MAX_BATCH_SIZE", 16, environ),
            max_seq_len=env.get_int(prefix + "MAX_SEQ_LEN", 0, environ),
            default_max_tokens=env.get_int(prefix + "DEFAULT_MAX_TOKENS", 256, environ),
            max_tokens_limit=env.get_int(prefix + "MAX_TOKENS_LIMIT", 4096, environ),
        )
