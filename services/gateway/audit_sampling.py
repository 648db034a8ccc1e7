"""Refusals of callers with no verified identity: written one by one up to a rate, then counted.

Anyone who can reach the gateway can send calls with a bad token, and each refusal is a fsynced
audit event of about 800 B: one client at a few hundred calls a second fills a disk in hours, and
a full audit disk refuses every caller by design. So unauthenticated refusals are written as
events up to `per_s` a second (bursts of `burst`); beyond that they are counted, by reason, and
one `audit.unauthenticated_summary` event records the counts: when the next such refusal is
written, at every summary interval, and when the gateway stops. Refusals of callers whose token
verified (RBAC, limits, sizes) are always written one by one: they have an identity to answer for.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from services.gateway.audit import DENY, AuditEvent

SUMMARY_ACTION = "audit.unauthenticated_summary"
_MAX_REASONS = 20  # distinct reasons named in one summary; the rest are counted together
_REASON_CHARS = 120


class UnauthenticatedDenials:
    """A token bucket of refusal events, and the counts of those it left out."""

    def __init__(
        self, per_s: float, burst: int | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if per_s < 0:
            raise ValueError(f"unauthenticated audit rate must be >= 0 events/s (0: every one), got {per_s}")
        self.per_s = per_s
        self.burst = burst if burst is not None else max(1, int(per_s * 10))
        self._clock = clock
        self._level = float(self.burst)
        self._at = clock()
        self._left_out: Counter[str] = Counter()
        self._since_utc = ""

    def admit(self) -> bool:
        """Whether this refusal is written as its own event; if not, `count` it."""
        if self.per_s == 0:
            return True
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._at) * self.per_s)
        self._at = now
        if self._level >= 1:
            self._level -= 1
            return True
        return False

    def count(self, reason: str, timestamp_utc: str) -> None:
        """Counts one refusal that was not written."""
        if not self._left_out:
            self._since_utc = timestamp_utc
        self._left_out[reason[:_REASON_CHARS]] += 1

    @property
    def num_left_out(self) -> int:
        """Refusals counted and not yet in a summary."""
        return sum(self._left_out.values())

    def take_summary(self) -> AuditEvent | None:
        """The summary of the refusals counted since the last one, or None; the counts restart."""
        if not self._left_out:
            return None
        counts, since = self._left_out, self._since_utc
        self._left_out = Counter()
        total = sum(counts.values())
        named = dict(counts.most_common(_MAX_REASONS))
        details: dict[str, object] = {"refusals": total, "since_utc": since, "by_reason": named}
        if others := total - sum(named.values()):
            details["other_reasons"] = others
        return AuditEvent(
            actor_principal="unauthenticated",
            tenant="",
            action=SUMMARY_ACTION,
            resource="gateway",
            decision=DENY,
            reason=f"{total} unauthenticated refusals over the audit rate, counted",
            details=details,
        )
