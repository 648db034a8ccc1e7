"""The in-loop safety gate: a linear head on the final normed hidden state, run inside each step.

The head comes from the gate file's `engine` head (services/common/gate_file.py), whose risk for
category c is sigmoid(logit_c - logit_benign) >= threshold_c. At start-up that is folded into one
matrix and one limit per category, so a step costs one small matmul and one compare on the
device: `(hidden @ weight_t) >= limits`. The [B, C] bool result stays on the device until the
engine fetches it together with the sampled token ids, so the gate adds no host sync.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

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
    announced_sha256: str = ""  # what the safety service's GetGate announced; empty if not asked
    detail: str = ""  # why, in words an operator can act on
    is_active: bool = False  # the head runs inside every step
    is_refusing: bool = False  # Generate is refused (a mismatch under the refuse policy)


class GateRefused(FailedPrecondition):
    """A request for a model whose gate failed its hash check, under the refuse policy."""


def refusal(report: GateReport) -> GateRefused:
    """The FAILED_PRECONDITION every request gets while `report.is_refusing`."""
    return GateRefused(
        f"this engine refuses to serve: its safety gate failed the hash check ({report.detail}). "
        "Deploy the same gate file to the engine and the safety service, or set "
        "THERMOCLINE_ENGINE_GATE_MISMATCH=warn to serve anyway"
    )


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
