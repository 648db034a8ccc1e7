"""The gateway's own Prometheus metrics (the per-RPC ones live in services/common/metrics.py)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

AUDIT_WRITE_FAILURES = Counter(
    "thermocline_gateway_audit_write_failures_total",
    "Audit batches that could not be written or fsynced (e.g. a full disk); their calls got UNAVAILABLE.",
)
AUDIT_WRITABLE = Gauge(
    "thermocline_gateway_audit_writable",
    "1 while the last audit write succeeded, 0 while the audit log cannot be written: alert on 0.",
)
AUDIT_WRITABLE.set(1)
