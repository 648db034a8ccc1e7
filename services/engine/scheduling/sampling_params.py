"""Per-request decoding settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# A temperature divides the logits: below MIN_TEMPERATURE the quotient can overflow fp32 to inf and the
# softmax turns NaN; above MAX_TEMPERATURE the distribution is uniform noise. 0 means greedy.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20  # larger than any vocabulary; 0 disables top-k


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. `temperature=0` means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = ()  # stop strings; the matched string is not part of the output text
    ignore_eos: bool = False  # keep going past EOS (benchmarks)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str | list):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        _check_range("max_new_tokens", self.max_new_tokens, 1, None, "ask for at least one new token")
        t = self.temperature
        if not (t == 0.0 or (math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t}"
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        _check_range("top_k", self.top_k, 0, MAX_TOP_K, "use 0 to disable top-k")
        if self.seed is not None:
            _check_range("seed", self.seed, 0, MAX_SEED, "or leave it unset for a random seed")
        self._check_stop()

    def _check_stop(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r:.64}")
            if len(s) > MAX_STOP_STRING_CHARS:
                limit = MAX_STOP_STRING_CHARS
                raise ValueError(f"a stop string may be at most {limit} characters, got {len(s)}")

    @property
    def is_greedy(self) -> bool:
        """True when the choice is always the most likely token."""
        return self.temperature == 0.0 or self.top_k == 1


def _check_range(name: str, value: int, low: int, high: int | None, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}; {hint}")
