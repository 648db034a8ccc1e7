"""The gateway's own Prometheus metrics (the per-RPC ones live in services/common/metrics.py)."""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter, Gauge

from services.common.service_auth import REFUSAL_LOG_INTERVAL_S, TOKEN_FILE_SETTING

log = logging.getLogger(__name__)

AUDIT_WRITE_FAILURES = Counter(
    "thermocline_gateway_audit_write_failures_total",
    "Audit batches that could not be written or fsynced (e.g. a full disk); their calls got UNAVAILABLE.",
)
AUDIT_UNWRITABLE = Gauge(
    "thermocline_gateway_audit_unwritable_seconds",
    "How long the audit log has been failing to write (0 while writes succeed): alert when above 0.",
)
STREAMS_IN_FLIGHT = Gauge(
    "thermocline_gateway_in_flight_requests",
    "Generate streams holding one of the gateway's admission slots now; past "
    "THERMOCLINE_GATEWAY_MAX_CONCURRENT_STREAMS new ones are shed with RESOURCE_EXHAUSTED.",
)

UPSTREAM_TOKEN_REFUSED = Gauge(
    "thermocline_gateway_upstream_token_refused_seconds",
    "How long an upstream (an engine replica or the safety service, by target) has refused the "
    "gateway's service token with UNAUTHENTICATED, 0 while it takes it: alert when above 0 "
    f"({TOKEN_FILE_SETTING} names different tokens on the two sides).",
    ["upstream", "target"],
)


class AuditHealth:
    """Since when the audit log has failed to write, if it is failing now; feeds the gauge."""

    def __init__(self) -> None:
        self.failing_since: float | None = None
        AUDIT_UNWRITABLE.set_function(self.unwritable_s)

    def unwritable_s(self) -> float:
        """Seconds since the first of the current run of failed writes; 0 while writes succeed."""
        return 0.0 if self.failing_since is None else time.monotonic() - self.failing_since

    def record_failure(self) -> None:
        """A batch could not be written."""
        AUDIT_WRITE_FAILURES.inc()
        if self.failing_since is None:
            self.failing_since = time.monotonic()

    def record_success(self) -> None:
        """A batch is on disk."""
        self.failing_since = None


class TokenHealth:
    """Since when one upstream has refused the gateway's service token, if it does now; feeds the
    gauge, and tells the operator in one ERROR per REFUSAL_LOG_INTERVAL_S while it lasts: its
    callers hear only that the gateway cannot reach a usable upstream."""

    def __init__(self, upstream: str, target: str) -> None:
        self.upstream = upstream  # "engine" or "safety"
        self.target = target
        self.refused_since: float | None = None
        self._logged_at: float | None = None
        UPSTREAM_TOKEN_REFUSED.labels(upstream, target).set_function(self.refused_s)

    @property
    def is_refused(self) -> bool:
        """Whether the upstream's last answer refused the token."""
        return self.refused_since is not None

    def refused_s(self) -> float:
        """Seconds since the first of the current run of refusals; 0 while the token is taken."""
        return 0.0 if self.refused_since is None else time.monotonic() - self.refused_since

    def record_refusal(self) -> None:
        """The upstream answered UNAUTHENTICATED."""
        now = time.monotonic()
        if self.refused_since is None:
            self.refused_since = now
        if self._logged_at is None or now - self._logged_at >= REFUSAL_LOG_INTERVAL_S:
            self._logged_at = now
            log.error(
                "%s %s refuses this gateway's service token (UNAUTHENTICATED, for %.0f s now): "
                "no call can go to it until both sides read the same token; check %s on this gateway "
                "and on the %s (the %s logs the file it reads)",
                self.upstream,
                self.target,
                self.refused_s(),
                TOKEN_FILE_SETTING,
                self.upstream,
                self.upstream,
            )

    def record_accepted(self) -> None:
        """The upstream answered a call that carried the token."""
        if self.refused_since is not None:
            self.refused_since = None
            log.info("%s %s takes this gateway's service token again", self.upstream, self.target)
