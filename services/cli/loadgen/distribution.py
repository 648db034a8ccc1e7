"""Length distributions for prompts and outputs, parsed from the workload file's inline tables."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

KINDS = ("constant", "uniform", "normal", "lognormal")


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts drawn per request, clamped to [min_tokens, max_tokens].

    constant: always `value`; uniform: integers in [min, max]; normal: mean ± std;
    lognormal: median · exp(sigma · N(0, 1)), the long right tail that real prompt lengths show.
    """

    kind: str
    value: float = 0.0
    spread: float = 0.0
    min_tokens: int = 1
    max_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown distribution {self.kind!r}; known: {', '.join(KINDS)}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min ({self.min_tokens}) <= max ({self.max_tokens}) tokens")
        if self.spread < 0:
            raise ValueError(f"a distribution's spread must be >= 0, got {self.spread}")

    @classmethod
    def constant(cls, num_tokens: int) -> LengthDistribution:
        """Always `num_tokens`."""
        return cls("constant", value=num_tokens, min_tokens=num_tokens, max_tokens=num_tokens)

    def sample(self, rng: random.Random) -> int:
        """One draw."""
        if self.kind == "constant":
            raw = self.value
        elif self.kind == "uniform":
            raw = rng.randint(self.min_tokens, self.max_tokens)
        elif self.kind == "normal":
            raw = rng.gauss(self.value, self.spread)
        else:  # lognormal
            raw = self.value * math.exp(self.spread * rng.gauss(0.0, 1.0))
        return int(min(self.max_tokens, max(self.min_tokens, round(raw))))

    def describe(self) -> dict[str, Any]:
        """The settings as the JSON report records them."""
        described: dict[str, Any] = {"dist": self.kind, "min": self.min_tokens, "max": self.max_tokens}
        if self.kind == "constant":
            return {"dist": "constant", "value": int(self.value)}
        if self.kind == "normal":
            described |= {"mean": self.value, "std": self.spread}
        elif self.kind == "lognormal":
            described |= {"median": self.value, "sigma": self.spread}
        return described


def parse_distribution(table: dict[str, Any], where: str) -> LengthDistribution:
    """A distribution from `{dist = "...", ...}`; errors name `where` and the bad key."""
    table = dict(table)
    kind = table.pop("dist", None)
    keys = {
        "constant": {"value"},
        "uniform": {"min", "max"},
        "normal": {"mean", "std", "min", "max"},
        "lognormal": {"median", "sigma", "min", "max"},
    }
    if kind not in keys:
        raise ValueError(f"{where}: 'dist' must be one of {', '.join(KINDS)}, got {kind!r}")
    unknown = set(table) - keys[kind]
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {sorted(unknown)} for dist {kind!r}; known: {sorted(keys[kind])}"
        )
    try:
        if kind == "constant":
            return LengthDistribution.constant(int(table["value"]))
        bounds = {"min_tokens": int(table.get("min", 1)), "max_tokens": int(table.get("max", 4096))}
        if kind == "uniform":
            return LengthDistribution("uniform", min_tokens=int(table["min"]), max_tokens=int(table["max"]))
        if kind == "normal":
            return LengthDistribution("normal", float(table["mean"]), float(table["std"]), **bounds)
        return LengthDistribution("lognormal", float(table["median"]), float(table["sigma"]), **bounds)
    except KeyError as missing:
        raise ValueError(f"{where}: dist {kind!r} needs key {missing}") from None
