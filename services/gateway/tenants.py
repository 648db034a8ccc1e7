"""Per-tenant limits: request rate, token rate, per-request token budget, Redis-down behaviour.

Every tenant gets the `defaults` block with its own entry laid over it. The file format (JSON)
is in deploy/gateway/tenants.json.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from services.gateway.config import load_policy_file

FAIL_OPEN, FAIL_CLOSED = "open", "closed"
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may use.

    `requests_per_s` refills a bucket of `burst_requests`; `tokens_per_min` refills a bucket of
    `burst_tokens` (default: `tokens_per_min`), charged the prompt at admission and the completion
    at the end. `max_request_tokens`
    caps prompt plus max_tokens of one request. `on_redis_down` says whether calls pass ("open")
    or are refused ("closed") while the shared limiter cannot be reached.
    """

    requests_per_s: float = 10.0
    burst_requests: int = 20
    tokens_per_min: int = 100_000
    burst_tokens: int | None = None
    max_request_tokens: int = 8192
    on_redis_down: str = FAIL_CLOSED
    intent_classes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.requests_per_s < 0 or self.burst_requests < 1:
            raise ValueError("requests_per_s must be >= 0 and burst_requests >= 1")
        if self.tokens_per_min < 1 or self.max_request_tokens < 1:
            raise ValueError("tokens_per_min and max_request_tokens must be >= 1")
        if self.burst_tokens is not None and self.burst_tokens < 1:
            raise ValueError(
                f"burst_tokens must be >= 1 (or absent: tokens_per_min), got {self.burst_tokens}"
            )
        if self.on_redis_down not in (FAIL_OPEN, FAIL_CLOSED):
            raise ValueError(f"on_redis_down must be 'open' or 'closed', got {self.on_redis_down!r}")

    @property
    def tokens_per_s(self) -> float:
        """The token bucket's refill rate."""
        return self.tokens_per_min / 60.0

    @property
    def token_capacity(self) -> int:
        """The most tokens the bucket holds: what a tenant may spend at once after idling."""
        return self.tokens_per_min if self.burst_tokens is None else self.burst_tokens


def _limits(base: TenantLimits, entry: Mapping[str, Any]) -> TenantLimits:
    known = {f.name for f in fields(TenantLimits)}
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"unknown tenant setting(s) {sorted(unknown)}; known: {sorted(known)}")
    return replace(base, **dict(entry))


@dataclass(frozen=True)
class TenantTable:
    """The limits of every tenant; tenants without an entry get `defaults`."""

    defaults: TenantLimits = field(default_factory=TenantLimits)
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> TenantTable:
        """A table from its parsed JSON."""
        defaults = _limits(TenantLimits(), dict(document.get("defaults", {})))
        tenants = {name: _limits(defaults, dict(e)) for name, e in dict(document.get("tenants", {})).items()}
        return cls(defaults=defaults, tenants=tenants)

    @classmethod
    def load(cls, path: Path) -> TenantTable:
        """Reads and validates a tenants file."""
        return load_policy_file(path, "tenant table", cls.from_dict)

    def limits(self, tenant: str) -> TenantLimits:
        """The limits that apply to `tenant`."""
        return self.tenants.get(tenant, self.defaults)


def is_valid_tenant(tenant: str) -> bool:
    """Whether a tenant id is safe to use as a Redis key part, cache salt and log field."""
    return _TENANT.fullmatch(tenant) is not None  # fullmatch: `$` would let a trailing newline in
