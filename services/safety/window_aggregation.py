"""How a harm category's window scores become one score per text.

A text that fits one embedder window is scored by that window. A longer text is cut into runs of
sentences, and one odd sentence among hundreds ("shoot the photos at dusk", a drug's overdose
section in a leaflet) should not flag the whole text the way a bare maximum lets it. So a long
view scores, per category, the higher of:

- the mean of its `top_k` highest windows: the text has to dwell on the topic;
- unless `lone_window_margin` is None, its highest window discounted by that many logits: a
  single window still counts when it is far past what benign sentences reach (a harmful request
  pasted into a long document), but not when it is merely over the threshold.

With `top_k = 1` this is the bare maximum. The gate's manifest carries the rule
(`heads.prompt.aggregation`); gates that predate it get the bare maximum, as they were calibrated.
bench/results/safety_heldout_*_gate3.md compares the rules, each calibrated on the same texts
(tools/calibrate_safety_gate.py chooses among them on calibration data only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.common.gate_file import GateFileError

AGGREGATION_KEY = "aggregation"  # in the manifest's prompt head entry


@dataclass(frozen=True)
class WindowAggregation:
    """Per-category scores of a view from its window scores; see the module docstring."""

    top_k: int = 1
    lone_window_margin: float | None = None  # logits subtracted from a lone window's score

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= 16:
            raise GateFileError(f"window aggregation top_k must be 1..16, got {self.top_k}")
        if self.lone_window_margin is not None and not 0.0 <= self.lone_window_margin <= 20.0:
            raise GateFileError(f"lone_window_margin must be 0..20 logits, got {self.lone_window_margin}")

    @property
    def is_bare_max(self) -> bool:
        """True when the rule is the plain maximum over windows."""
        return self.top_k == 1

    def view_scores(self, window_scores: torch.Tensor) -> torch.Tensor:
        """Scores `[C]` of one view from its window scores `[W, C]` (each in [0, 1])."""
        num_windows = window_scores.shape[0]
        if num_windows == 1:  # a short text: its window's scores, as the maximum of one would give
            return window_scores[0]
        if self.is_bare_max:
            return window_scores.max(dim=0).values
        top = window_scores.topk(min(self.top_k, num_windows), dim=0).values  # [k, C]
        if self.lone_window_margin is None:
            return top.mean(dim=0)
        lone = torch.sigmoid(torch.logit(top[0], eps=1e-7) - self.lone_window_margin)  # [C]
        return torch.maximum(top.mean(dim=0), lone)

    def text_scores(self, views: list[torch.Tensor]) -> torch.Tensor:
        """Scores `[C]` of a text from each view's window scores: the highest over views.

        A chat's check scores thousands of views of one window each (turns, clauses, joins), and a
        reduction over a dimension runs in the thread pool: tens of microseconds each with two
        threads, and milliseconds on a loaded CPU, where the pool's other thread waits for a core
        (1,896 views' maxima took 6-14 s of a 400-message chat's check). So a view of one window
        is read, not reduced, and the views are reduced once."""
        return torch.stack([self.view_scores(v) for v in views]).max(dim=0).values

    def to_manifest(self) -> dict[str, Any]:
        """The manifest entry."""
        return {"top_k": self.top_k, "lone_window_margin": self.lone_window_margin}

    @classmethod
    def from_manifest(cls, spec: dict[str, Any] | None) -> WindowAggregation:
        """The rule a manifest entry names; the bare maximum when there is none."""
        if spec is None:
            return cls()
        if not isinstance(spec, dict):
            raise GateFileError(f"prompt head {AGGREGATION_KEY} must be an object, got {spec!r}")
        top_k, margin = spec.get("top_k", 1), spec.get("lone_window_margin")
        if not isinstance(top_k, int) or not isinstance(margin, int | float | None):
            raise GateFileError(
                f"prompt head {AGGREGATION_KEY} needs an int top_k and a number or null margin"
            )
        return cls(top_k, None if margin is None else float(margin))
