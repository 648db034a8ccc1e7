"""The attack categories: probes for the attack itself, not for a harm topic. `jailbreak` reads
jailbreak templates (role-play overrides, "developer mode", rules against refusing, adversarial
suffixes); `prompt_injection` reads instructions that hijack the task (an "ignore the previous
instructions" line, an instruction hidden in a document to summarise, a request for the system
prompt). One linear probe fitted to both kinds lost most of its jailbreak recall on the choice
set, so each kind has its own probe and its own threshold; a gate may carry either or both.

The harm categories judge each window on its own (a harmful sentence is harmful wherever it sits),
so they take the maximum over windows. A jailbreak template is a property of the whole text:
its windows one by one read as role-play or rules of a game, and a single window of an ordinary
long prompt can look like an instruction override. So this head scores each view twice, as a
whole (the mean of its window embeddings, L2-normalised: one row for a short text) and by its
windows (the mean of the `top_k` highest window scores), and takes the higher. Training picks
`top_k` with the weight decay; bench/results/safety_heldout_*.md compares the aggregations.

The head lives in the gate file beside the harm heads, under the manifest's `attack_heads` (a
binary probe does not fit the `heads` format, whose rows are the shared harm categories). Its
tensors are covered by the file's sha256 and version like every other; the engine ignores them:
the in-loop gate reads generated text, where a template does not occur.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from services.common.gate_file import PROMPT_HEAD, Gate, GateFileError

ATTACK_HEADS = "attack_heads"  # the manifest key
JAILBREAK = "jailbreak"
PROMPT_INJECTION = "prompt_injection"


@dataclass(frozen=True)
class AttackHead:
    """A linear probe over sentence embeddings: risk = sigmoid(embedding @ weight + bias)."""

    name: str
    weight: torch.Tensor  # [H]
    bias: float
    threshold: float  # calibrated on benign prompts of several sources and lengths
    top_k: int  # windows averaged for the window score

    @classmethod
    def from_gate(cls, gate: Gate, name: str = JAILBREAK) -> AttackHead | None:
        """The gate's named attack head; None when the gate predates it."""
        spec = gate.manifest.raw.get(ATTACK_HEADS, {}).get(name)
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise GateFileError(f"gate {gate.version}: attack head {name!r} must be an object, got {spec!r}")
        weight, bias = _tensors(gate, name, spec)
        return cls(name, weight, float(bias), _threshold(name, spec), _top_k(name, spec))

    @classmethod
    def all_from_gate(cls, gate: Gate) -> list[AttackHead]:
        """Every attack head of the gate, in manifest order."""
        return [
            head for name in gate.manifest.raw.get(ATTACK_HEADS, {}) if (head := cls.from_gate(gate, name))
        ]

    def row_scores(self, rows: torch.Tensor) -> torch.Tensor:
        """Risk `[N]` of embeddings `[N, H]`."""
        return torch.sigmoid(rows @ self.weight + self.bias)

    def view_score(self, rows: torch.Tensor) -> float:
        """One view's risk from its window embeddings `[W, H]`: max(whole, top-k window mean)."""
        if len(rows) == 1:  # one window is its mean and its top-k: fewer reductions (window_aggregation.py)
            whole = F.normalize(rows, dim=-1)
            return float(torch.maximum(self.row_scores(whole)[0], self.row_scores(rows)[0]))
        whole = F.normalize(rows.mean(0, keepdim=True), dim=-1)  # [1, H]
        per_window = self.row_scores(rows)  # [W]
        top = per_window.topk(min(self.top_k, len(per_window))).values.mean()
        return float(torch.maximum(self.row_scores(whole)[0], top))

    def score(self, views: list[torch.Tensor]) -> float:
        """A text's risk: the highest over its views (each `[W, H]`)."""
        return max(self.view_score(rows) for rows in views)


def tensor_names(name: str, spec: dict[str, Any]) -> tuple[str, str]:
    """The gate tensors (weight, bias) that hold the attack head `name` with manifest entry `spec`."""
    prefix = spec.get("tensor", name)
    return f"{prefix}.weight", f"{prefix}.bias"


def _tensors(gate: Gate, name: str, spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    weight_name, bias_name = tensor_names(name, spec)
    weight, bias = gate.tensors.get(weight_name), gate.tensors.get(bias_name)
    if weight is None or bias is None or weight.ndim != 2 or weight.shape[0] != 1 or bias.numel() != 1:
        raise GateFileError(
            f"gate {gate.version}: attack head {name!r} needs tensors {weight_name} [1, H] and "
            f"{bias_name} [1]"
        )
    harm = gate.tensors.get(f"{PROMPT_HEAD}.weight")  # the embedder's width, which both heads read
    if harm is not None and weight.shape[1] != harm.shape[1]:
        raise GateFileError(
            f"gate {gate.version}: attack head {name!r} reads {weight.shape[1]}-wide embeddings, the "
            f"{PROMPT_HEAD} head {harm.shape[1]}-wide"
        )
    return weight[0], bias[0]


def _top_k(name: str, spec: dict[str, Any]) -> int:
    top_k = spec.get("top_k", 1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise GateFileError(f"attack head {name!r} top_k must be an integer >= 1, got {top_k!r}")
    return top_k


def _threshold(name: str, spec: dict[str, Any]) -> float:
    threshold = spec.get("threshold")
    if not isinstance(threshold, int | float) or not 0.0 < threshold <= 1.0:
        raise GateFileError(f"attack head {name!r} threshold must lie in (0, 1], got {threshold!r}")
    return float(threshold)
