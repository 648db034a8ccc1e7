"""The deny-pattern policy: an operator's list of regular expressions, applied to normalised text.

It is an extra operator layer beside the learned classifier (see screen.py): any match blocks.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from services.safety.normalizer import normalize, pattern_views, prompt_readings, views
from services.safety.restate import prompt_restatements

__all__ = ["DenyPatternPolicy", "DenyRule", "PolicyError", "Verdict", "normalize"]


class PolicyError(ValueError):
    """The policy file cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class DenyRule:
    """One line of the policy file."""

    category: str
    pattern: re.Pattern[str]
    line_number: int


@dataclass(frozen=True)
class Verdict:
    """The outcome of screening one text."""

    is_blocked: bool
    # The categories that matched, each as "category (line N)", for the audit log.
    reasons: tuple[str, ...]
    # Every category of the policy with 1.0 if it matched, else 0.0.
    scores: dict[str, float]


def _parse_line(line: str, line_number: int, path: Path) -> DenyRule | None:
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    category, sep, expression = stripped.partition(":")
    if not sep or not category.strip() or not expression.strip():
        raise PolicyError(f"{path}:{line_number}: expected 'category: pattern', got {stripped!r}")
    try:
        pattern = re.compile(expression.strip(), re.IGNORECASE)
    except re.error as error:
        raise PolicyError(f"{path}:{line_number}: pattern does not compile: {error}") from None
    return DenyRule(category.strip(), pattern, line_number)


def _decoded(data: bytes, path: Path) -> str:
    """The file's text; PolicyError naming the line of the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = data.count(b"\n", 0, error.start) + 1
        raise PolicyError(
            f"{path}:{line_number}: not UTF-8 (byte {data[error.start]:#04x} at offset {error.start}); "
            "save the file as UTF-8"
        ) from None


class DenyPatternPolicy:
    """Blocks text that matches any rule of the file it was loaded from."""

    def __init__(self, rules: list[DenyRule], version: str) -> None:
        self.rules = rules
        self.version = version
        self.categories = sorted({rule.category for rule in rules})

    @classmethod
    def load(cls, path: Path) -> DenyPatternPolicy:
        """Parses the policy file; its version is the start of the file's sha256. PolicyError for a
        file that is not UTF-8 or holds no rule: the layer no tenant can waive would vanish, with
        nothing to show for it but another version string."""
        try:
            data = path.read_bytes()
        except OSError as error:
            raise PolicyError(f"cannot read deny-pattern file {path}: {error.strerror}") from None
        lines = _decoded(data, path).splitlines()
        rules = [rule for n, line in enumerate(lines, 1) if (rule := _parse_line(line, n, path))]
        if not rules:
            raise PolicyError(
                f"deny-pattern file {path} holds no rule ({len(data)} bytes, {len(lines)} lines): "
                "it is empty or cut short; restore it (the shipped one is services/safety/deny_patterns.txt)"
            )
        return cls(rules, version="deny-patterns-" + hashlib.sha256(data).hexdigest()[:12])

    def check(self, text: str, kind: str = "prompt") -> Verdict:
        """Screens `text`; blocked when any rule matches one of its views (normalised, decoded)
        or, for a prompt, one of its restatements (restate.py: "how did people make X" is read
        as "how to make X", which is what the rules are written for), or one of these with
        accents dropped or HTML character references decoded (normalizer.pattern_views)."""
        forms = views(text)
        if kind == "prompt":
            forms += prompt_restatements(prompt_readings(text, forms[0]))
        forms += pattern_views(text, forms)
        matched = [rule for rule in self.rules if any(rule.pattern.search(form) for form in forms)]
        hit = {rule.category for rule in matched}
        return Verdict(
            is_blocked=bool(matched),
            reasons=tuple(f"{rule.category} (line {rule.line_number})" for rule in matched),
            scores={category: float(category in hit) for category in self.categories},
        )


def merged(verdicts: list[Verdict]) -> Verdict:
    """One verdict for several texts read as one (a chat's turns): every rule any of them matched,
    once, and each category's highest score."""
    reasons = tuple(dict.fromkeys(reason for verdict in verdicts for reason in verdict.reasons))
    categories = {category for verdict in verdicts for category in verdict.scores}
    scores = {c: max(v.scores.get(c, 0.0) for v in verdicts) for c in sorted(categories)}
    return Verdict(is_blocked=bool(reasons), reasons=reasons, scores=scores)
