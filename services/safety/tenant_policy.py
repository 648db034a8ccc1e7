"""A tenant's adjustments to the gate: categories turned off, and categories on a looser threshold.

The gateway sends the tenant's policy (from its tenants file) with every check; the screen applies
it. A policy can only loosen: a category's threshold is the higher of the gate's own (per surface,
prompt or output) and the tenant's, so a policy written for one gate never tightens a later one.
The deny patterns are the operator's own layer, not the gate's categories, and always apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.common.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class TenantPolicy:
    """Which categories never block a tenant, and which block only at a higher score."""

    categories_off: frozenset[str] = frozenset()
    thresholds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {c: t for c, t in self.thresholds.items() if not 0.0 < t <= 1.0}
        if bad:
            raise InvalidArgument(f"tenant policy thresholds must lie in (0, 1], got {bad}")

    @property
    def is_empty(self) -> bool:
        """True when the policy leaves the gate as it is."""
        return not self.categories_off and not self.thresholds

    def check_known(self, categories: Iterable[str], gate_version: str) -> None:
        """FAILED_PRECONDITION when the policy names a category the gate does not have: the
        tenants file was written for another gate, and guessing could leave a category on."""
        known = set(categories)
        unknown = sorted((self.categories_off | set(self.thresholds)) - known)
        if unknown:
            raise FailedPrecondition(
                f"the tenant's safety policy names {unknown}, which gate {gate_version} does not "
                f"have (its categories: {sorted(known)}); the operator must fix the gateway's "
                "tenants file"
            )

    def thresholds_for(self, gate_thresholds: Mapping[str, float]) -> dict[str, float]:
        """The thresholds in force: per category, the higher of the gate's and the tenant's."""
        return {c: max(t, self.thresholds.get(c, 0.0)) for c, t in gate_thresholds.items()}

    def describe(self) -> str:
        """The policy as one line for the audit log; "" when empty."""
        parts = []
        if self.categories_off:
            parts.append("off: " + ", ".join(sorted(self.categories_off)))
        if self.thresholds:
            pairs = ", ".join(f"{c}={t:g}" for c, t in sorted(self.thresholds.items()))
            parts.append("thresholds: " + pairs)
        return "; ".join(parts)


NO_POLICY = TenantPolicy()
