"""Refusals that cost the caller nothing: written one by one up to a rate, then counted.

Each refusal is a fsynced audit event of about 800 B, and a full audit disk refuses every caller by
design. Most refusals cost the caller a request from its tenant's bucket, which bounds them. Some
cost nothing, and one client sending them at a few hundred calls a second fills a disk in hours:

- refusals of callers with no verified identity (a bad or missing token; also a prompt over the
  byte limit, refused before the token is read), sampled together under THERMOCLINE_GATEWAY_AUDIT_
  UNAUTHENTICATED_PER_S;
- refusals of a verified caller that take nothing from its bucket: its rate limit or stream cap
  reached (RESOURCE_EXHAUSTED), and the HTTP front's own refusals of a body (bad JSON, a field out
  of range), sampled per tenant under THERMOCLINE_GATEWAY_AUDIT_FREE_REFUSALS_PER_S.

Each sampler writes events up to `per_s` a second (bursts of ten seconds' worth); beyond that it
counts them by reason, and one summary event records the counts every summary interval (a minute)
and when the gateway stops (a summary before each written event would double the rate). A summary
that cannot be written (a full disk) keeps its counts for the next one. Reasons quote what the
caller sent (a token's header), so at most MAX_TRACKED_REASONS distinct ones are kept apart between
summaries; the rest are counted together. Every other refusal is written one by one.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from services.gateway.audit import DENY, UNAUTHENTICATED, AuditEvent

SUMMARY_ACTION = "audit.unauthenticated_summary"
TENANT_SUMMARY_ACTION = "audit.tenant_refusal_summary"
_MAX_REASONS = 20  # distinct reasons named in one summary; the rest are counted together
MAX_TRACKED_REASONS = 200  # distinct reasons counted apart between summaries
_OTHER = "(other reasons)"
_REASON_CHARS = 120


class DenialSampler:
    """A token bucket of refusal events for one key (the unauthenticated, or one tenant), and the
    counts of the refusals it left out."""

    def __init__(
        self,
        tenant: str,
        per_s: float,
        burst: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_s < 0:
            raise ValueError(f"an audit rate must be >= 0 events/s (0: every one), got {per_s}")
        self.tenant = tenant  # "" for the unauthenticated
        self.per_s = per_s
        self.burst = burst if burst is not None else max(1, int(per_s * 10))
        self._clock = clock
        self._level = float(self.burst)
        self._at = clock()
        self._left_out: Counter[str] = Counter()
        self._since_utc = ""
        self._pending: Counter[str] = Counter()  # the counts of the summary being written

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
        key = reason[:_REASON_CHARS]
        if key not in self._left_out and len(self._left_out) >= MAX_TRACKED_REASONS:
            key = _OTHER
        self._left_out[key] += 1

    @property
    def num_reasons(self) -> int:
        """Distinct reasons counted and not yet in a written summary."""
        return len(self._left_out)

    def summary(self) -> AuditEvent | None:
        """The summary of the refusals counted since the last one written, or None. Its counts
        leave the tally only once `written` says the event is on disk."""
        if not self._left_out:
            return None
        counts, since = Counter(self._left_out), self._since_utc
        self._pending = counts
        total = sum(counts.values())
        named = dict(counts.most_common(_MAX_REASONS))
        details: dict[str, object] = {"refusals": total, "since_utc": since, "by_reason": named}
        if others := total - sum(named.values()):
            details["other_reasons"] = others
        if self.tenant:
            action, reason = (
                TENANT_SUMMARY_ACTION,
                f"{total} refusals of tenant {self.tenant!r} over the audit rate",
            )
        else:
            action, reason = SUMMARY_ACTION, f"{total} unauthenticated refusals over the audit rate"
        return AuditEvent(
            actor_principal=UNAUTHENTICATED if not self.tenant else "",
            tenant=self.tenant,
            action=action,
            resource="gateway",
            decision=DENY,
            reason=f"{reason}, counted",
            details=details,
        )

    def written(self) -> None:
        """The last `summary` is on disk: its counts leave the tally (refusals counted while it
        was written stay for the next one)."""
        self._left_out -= self._pending
        self._pending = Counter()
