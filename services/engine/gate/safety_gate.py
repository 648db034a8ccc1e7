"""The in-loop safety gate: a linear head on the final normed hidden state, run inside each step.

The head comes from the gate file's `engine` head (services/common/gate_file.py), whose risk for
category c is sigmoid(logit_c - logit_benign) >= threshold_c. At start-up that is folded into one
matrix and one limit per category, so a step costs one small matmul and one compare on the
device: `(hidden @ weight_t) >= limits`. The [B, C] bool result stays on the device until the
engine fetches it together with the sampled token ids, so the gate adds no host sync.

A request may carry its tenant's `GatePolicy` (categories off, looser thresholds), as the safety
service applies it. A policy can only keep a category from firing, so it is consulted only for a
row that fired: that row's scores are read then (one more sync, on a rare step).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from services.common.errors import FailedPrecondition
from services.common.gate_file import HeadWeights

DEFAULT_SAFE_MESSAGE = "I can't help with that request."


class GateStatus(enum.Enum):
    """How the engine's gate relates to the served model and to the safety service's gate."""

    OK = "ok"  # loaded, covers the served model, sha256 equals the one safety announces
    MISMATCH = "mismatch"  # the weights' sha256 differs from the manifest's or from safety's
    UNVERIFIED = "unverified"  # loaded and covering the model, but safety was not asked or did not answer
    UNCOVERED = "uncovered"  # the gate's engine head reads another model: this one is served ungated
    ABSENT = "absent"  # no gate configured: served ungated


@dataclass(frozen=True)
class GateReport:
    """What the engine reports about its gate (GetModelInfo, /metrics, logs)."""

    status: GateStatus
    version: str = ""
    sha256: str = ""  # of the weights the engine holds
    announced_sha256: str = ""  # what the safety service's GetGate last announced; empty if never
    detail: str = ""  # why, in words an operator can act on
    is_active: bool = False  # the head runs inside every step (refusing: on the streams admitted before)
    is_refusing: bool = False  # Generate is refused (a mismatch under the refuse policy)


class GateRefused(FailedPrecondition):
    """A request for a model whose gate failed its hash check, under the refuse policy."""


def refusal(report: GateReport) -> GateRefused:
    """The FAILED_PRECONDITION every request gets while `report.is_refusing`."""
    return GateRefused(
        f"this engine refuses to serve: its safety gate failed the hash check ({report.detail}). "
        "Deploy the same gate to the engine and the safety service, or set "
        "THERMOCLINE_ENGINE_GATE_MISMATCH=warn to serve anyway"
    )


MAX_POLICY_CATEGORIES = 64  # entries in one request's GatePolicy (categories off and thresholds)


@dataclass(frozen=True)
class GatePolicy:
    """A tenant's changes to the gate: categories that never fire, thresholds that only loosen."""

    categories_off: frozenset[str] = frozenset()
    thresholds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.categories_off) + len(self.thresholds) > MAX_POLICY_CATEGORIES:
            raise ValueError(f"a gate policy names at most {MAX_POLICY_CATEGORIES} categories")
        for name in (*self.categories_off, *self.thresholds):
            if not name or len(name) > 64:
                raise ValueError(f"gate policy category names are 1-64 characters, got {name[:80]!r}")
        for name, value in self.thresholds.items():
            if not 0 < value <= 1:  # NaN fails this too
                raise ValueError(f"gate policy threshold for {name!r} must lie in (0, 1], got {value!r}")

    def __bool__(self) -> bool:
        return bool(self.categories_off or self.thresholds)


class InLoopGate:
    """The engine head on the device, folded so that one matmul and one compare give the fired flags."""

    def __init__(
        self, head: HeadWeights, categories: tuple[str, ...], safe_message: str, device: torch.device
    ) -> None:
        weight = head.weight[1:] - head.weight[:1]  # [C, H]: logit_c - logit_benign
        bias = head.bias[1:] - head.bias[:1]  # [C]
        # sigmoid(x + b) >= t  <=>  x >= logit(t) - b; a threshold of 1 gives +inf and never fires
        limits = torch.logit(head.thresholds.double()) - bias.double()  # [C]
        self.weight_t = weight.T.contiguous().to(device=device, dtype=torch.float32)  # [H, C]
        self.limits = limits.to(device=device, dtype=torch.float32)  # [C]
        self.bias = bias.float().tolist()  # [C] host copies for a policy's re-check
        self.thresholds = head.thresholds.float().tolist()
        self.categories = categories
        self.safe_message = safe_message

    @property
    def num_categories(self) -> int:
        """C: the columns of `flags`."""
        return len(self.categories)

    def flags(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, C]` bool on the device: which categories reach their threshold, from `[B, H]` states."""
        return hidden.float() @ self.weight_t >= self.limits

    def fired(self, row_flags: list[int]) -> tuple[str, ...]:
        """The categories named by one row of `flags`, fetched to the host."""
        return tuple(c for c, flag in zip(self.categories, row_flags, strict=True) if flag)

    def fired_under(
        self, policy: GatePolicy, fired: tuple[str, ...], hidden: torch.Tensor
    ) -> tuple[str, ...]:
        """Of the categories that `fired` for one row (final state `[H]`), those the policy keeps.

        A category off never fires; one with a higher threshold fires only if its score reaches it.
        """
        kept = [c for c in fired if c not in policy.categories_off]
        looser = [
            c for c in kept if policy.thresholds.get(c, 0.0) > self.thresholds[self.categories.index(c)]
        ]
        if not looser:
            return tuple(kept)
        logits = (hidden.float() @ self.weight_t).tolist()  # [C]: syncs, on a row that fired
        scores = {  # a threshold of 1 never fires, as in the folded limits (logit(1) = +inf)
            c: 1.0 / (1.0 + math.exp(-(logits[i] + self.bias[i]))) if policy.thresholds[c] < 1 else -1.0
            for i, c in enumerate(self.categories)
            if c in looser
        }
        return tuple(c for c in kept if c not in scores or scores[c] >= policy.thresholds[c])
