"""The learned screen: every view of a text, cut into windows, embedded, scored by the gate's
prompt head; a category's score is its maximum over all windows of all views.

Prompts and outputs share the head but not the thresholds: each is judged against thresholds
calibrated on benign texts of its own kind (the manifest's `thresholds` and `output_thresholds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.common.gate_file import PROMPT_HEAD, Gate, HeadWeights, gate_scores
from services.safety.embedder import MiniLMEmbedder
from services.safety.normalizer import views

TextKind = Literal["prompt", "output"]


class TextTooLong(ValueError):
    """The text needs more embedder windows than the service screens per check."""


@dataclass(frozen=True)
class Scores:
    """Per-category risk of one text, with the thresholds it was judged against."""

    values: dict[str, float]
    thresholds: dict[str, float]
    num_windows: int

    @property
    def triggered(self) -> list[str]:
        """The categories at or above their threshold."""
        return [c for c, v in self.values.items() if v >= self.thresholds[c]]


class TextClassifier:
    """Scores texts with all-MiniLM-L6-v2 embeddings and the gate's prompt head."""

    def __init__(self, gate: Gate, embedder: MiniLMEmbedder, max_windows: int) -> None:
        self.embedder = embedder
        self.max_windows = max_windows
        self.categories = gate.manifest.categories
        self.head: HeadWeights = gate.head_weights(PROMPT_HEAD)
        output_head = gate.head_weights(PROMPT_HEAD, for_outputs=True)
        self.thresholds: dict[TextKind, dict[str, float]] = {
            "prompt": dict(zip(self.categories, self.head.thresholds.tolist(), strict=True)),
            "output": dict(zip(self.categories, output_head.thresholds.tolist(), strict=True)),
        }

    def windows_of(self, text: str) -> list[list[int]]:
        """Every window of every view of `text`; TextTooLong past `max_windows`."""
        rows = screen_rows(self.embedder, text)
        if len(rows) > self.max_windows:
            raise TextTooLong(
                f"text needs {len(rows)} screening windows (one per sentence of a long text); "
                f"the limit is {self.max_windows}: shorten it or send it in several requests"
            )
        return rows

    def score(self, text: str, kind: TextKind = "prompt") -> Scores:
        """The text's per-category scores (max over views and windows), with the thresholds
        for its kind."""
        rows = self.windows_of(text)
        per_window = gate_scores(self.embedder.embed_windows(rows), self.head)  # [N, C]
        top = per_window.max(dim=0).values.tolist()
        return Scores(
            values=dict(zip(self.categories, top, strict=True)),
            thresholds=self.thresholds[kind],
            num_windows=len(rows),
        )


def screen_rows(embedder: MiniLMEmbedder, text: str) -> list[list[int]]:
    """Every window of every view of `text`: the rows one check embeds (training reuses it)."""
    return [window for view in views(text) for window in embedder.text_windows(view)]
