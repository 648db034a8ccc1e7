"""The safety service's settings, read from `THERMOCLINE_SAFETY_*` variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common import env
from services.common.config import ServerConfig

DEFAULT_PORT = 50053
DEFAULT_PATTERNS = Path(__file__).with_name("deny_patterns.txt")
DEFAULT_SAFE_MESSAGE = "I can't help with that request."


@dataclass(frozen=True)
class SafetyConfig:
    """Which policy screens prompts and outputs, and what a blocked user is told.

    `THERMOCLINE_SAFETY_DENY_PATTERNS`: the deny-pattern file (see deny_patterns.txt for the format).
    `THERMOCLINE_SAFETY_SAFE_MESSAGE`: the text returned instead of a blocked completion.
    """

    server: ServerConfig
    deny_patterns_path: Path
    safe_message: str

    def __post_init__(self) -> None:
        if not self.safe_message:
            raise ValueError("THERMOCLINE_SAFETY_SAFE_MESSAGE must not be empty")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SafetyConfig:
        """Reads the safety service's settings."""
        return cls(
            server=ServerConfig.from_env("safety", DEFAULT_PORT, environ),
            deny_patterns_path=Path(
                env.get_str("THERMOCLINE_SAFETY_DENY_PATTERNS", str(DEFAULT_PATTERNS), environ)
            ),
            safe_message=env.get_str("THERMOCLINE_SAFETY_SAFE_MESSAGE", DEFAULT_SAFE_MESSAGE, environ),
        )
