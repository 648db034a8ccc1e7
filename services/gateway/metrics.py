"""The gateway's own Prometheus metrics (the per-RPC ones live in services/common/metrics.py)."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge

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
