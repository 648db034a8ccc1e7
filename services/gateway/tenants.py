"""Per-tenant limits: request rate, token rate, per-request token budget, Redis-down behaviour,
and the safety categories a tenant has turned off or loosened.

Every tenant gets the `defaults` block with its own entry laid over it. The file format (JSON)
is in deploy/gateway/tenants.json and deploy/gateway/README.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

from services.common.tenancy import RESERVED_TENANTS
from services.gateway.config import load_policy_file

FAIL_OPEN, FAIL_CLOSED = "open", "closed"
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
_CATEGORY = re.compile(r"[a-z][a-z0-9_]{0,63}")
_SAFETY_KEYS = ("categories_off", "thresholds")
# A tenant's Generate streams in flight on one gateway unless its entry says otherwise: a quarter of
# the gateway's default cap of 256, and 4 times the engine's default batch of 16, so a tenant past it
# is queueing, not streaming. At its default rate (10 requests/s after a burst of 20) a tenant holds
# 64 only with streams that last over 4 s each while it sends at full rate.
DEFAULT_MAX_STREAMS = 64


@dataclass(frozen=True)
class SafetyOverrides:
    """The gate categories a tenant has turned off or loosened; the safety service applies them.

    `categories_off`: categories that never block the tenant's prompts or outputs. `thresholds`:
    a category blocks only at this score or above, in (0, 1]; it may only loosen (the safety
    service applies the higher of it and the gate's own, per surface), and at start-up one below
    the gate's own on every surface is refused (`check_against_gate`). The operator's deny
    patterns are not categories and always apply.
    """

    categories_off: frozenset[str] = frozenset()
    thresholds: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in sorted(self.categories_off | set(self.thresholds)):
            if not isinstance(name, str) or _CATEGORY.fullmatch(name) is None:
                raise ValueError(f"safety: {name!r} is not a category name (lower case, digits, _)")
        for name, value in self.thresholds.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise ValueError(f"safety.thresholds.{name} must lie in (0, 1], got {value!r}")
        both = sorted(self.categories_off & set(self.thresholds))
        if both:
            raise ValueError(f"safety: {both} are both off and given a threshold; keep one")

    @classmethod
    def from_dict(cls, document: Any) -> SafetyOverrides:
        """The `safety` object of a tenants file entry."""
        if not isinstance(document, Mapping):
            raise ValueError(f"safety must be an object with {list(_SAFETY_KEYS)}, got {document!r}")
        unknown = set(document) - set(_SAFETY_KEYS)
        if unknown:
            raise ValueError(f"unknown safety setting(s) {sorted(unknown)}; known: {list(_SAFETY_KEYS)}")
        off = document.get("categories_off", [])
        if not isinstance(off, list):
            raise ValueError(f"safety.categories_off must be a list of category names, got {off!r}")
        thresholds = document.get("thresholds", {})
        if not isinstance(thresholds, Mapping):
            raise ValueError(f"safety.thresholds must map category names to numbers, got {thresholds!r}")
        return cls(frozenset(off), dict(thresholds))

    @property
    def is_empty(self) -> bool:
        """True when the tenant is screened by the gate as it is."""
        return not self.categories_off and not self.thresholds

    @property
    def categories(self) -> frozenset[str]:
        """Every category the overrides name."""
        return self.categories_off | frozenset(self.thresholds)

    def describe(self) -> str:
        """One line for the audit log, in the safety service's words; "" when empty."""
        parts = []
        if self.categories_off:
            parts.append("off: " + ", ".join(sorted(self.categories_off)))
        if self.thresholds:
            parts.append("thresholds: " + ", ".join(f"{c}={t:g}" for c, t in sorted(self.thresholds.items())))
        return "; ".join(parts)


class GateCategory(NamedTuple):
    """The gate's own thresholds for one category (output None: outputs are not screened for it)."""

    prompt_threshold: float
    output_threshold: float | None

    @property
    def thresholds(self) -> dict[str, float]:
        """The gate's threshold per surface it screens for this category."""
        surfaces = {"prompt": self.prompt_threshold, "output": self.output_threshold}
        return {surface: t for surface, t in surfaces.items() if t is not None}


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may use.

    `requests_per_s` refills a bucket of `burst_requests`; `tokens_per_min` refills a bucket of
    `burst_tokens` (default: `tokens_per_min`), from which a call reserves its prompt plus max_tokens
    at admission and gets back, when it ends, what its completion did not use. `max_request_tokens` caps
    prompt plus max_tokens of one request. `max_streams` caps the tenant's Generate streams in
    flight on one gateway process (default `DEFAULT_MAX_STREAMS`; 0: only the gateway's own cap),
    so one tenant cannot hold every stream slot. `on_redis_down` says whether
    calls pass ("open") or are refused ("closed") while the shared limiter cannot be reached. `safety`: see
    SafetyOverrides; an entry's `safety` replaces the defaults' as a whole.
    """

    requests_per_s: float = 10.0
    burst_requests: int = 20
    tokens_per_min: int = 100_000
    burst_tokens: int | None = None
    max_request_tokens: int = 8192
    max_streams: int = DEFAULT_MAX_STREAMS
    on_redis_down: str = FAIL_CLOSED
    intent_classes: Mapping[str, str] = field(default_factory=dict)
    safety: SafetyOverrides = field(default_factory=SafetyOverrides)

    def __post_init__(self) -> None:
        if self.requests_per_s < 0 or self.burst_requests < 1:
            raise ValueError("requests_per_s must be >= 0 and burst_requests >= 1")
        if self.tokens_per_min < 1 or self.max_request_tokens < 1:
            raise ValueError("tokens_per_min and max_request_tokens must be >= 1")
        if self.burst_tokens is not None and self.burst_tokens < 1:
            raise ValueError(
                f"burst_tokens must be >= 1 (or absent: tokens_per_min), got {self.burst_tokens}"
            )
        if self.max_streams < 0:
            raise ValueError(
                f"max_streams must be >= 0 (0: no cap of the tenant's own), got {self.max_streams}"
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


def _limits(base: TenantLimits, entry: Mapping[str, Any], where: str) -> TenantLimits:
    """`base` with `entry` laid over it; a ValueError names `where` ("tenant 'acme'", "defaults")."""
    known = {f.name for f in fields(TenantLimits)}
    unknown = set(entry) - known
    try:
        if unknown:
            raise ValueError(f"unknown tenant setting(s) {sorted(unknown)}; known: {sorted(known)}")
        if "safety" in entry:
            entry = {**entry, "safety": SafetyOverrides.from_dict(entry["safety"])}
        return replace(base, **dict(entry))
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: {error}") from None


@dataclass(frozen=True)
class TenantTable:
    """The limits of every tenant; tenants without an entry get `defaults`."""

    defaults: TenantLimits = field(default_factory=TenantLimits)
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> TenantTable:
        """A table from its parsed JSON."""
        defaults = _limits(TenantLimits(), dict(document.get("defaults", {})), "defaults")
        reserved = sorted(RESERVED_TENANTS & set(dict(document.get("tenants", {}))))
        if reserved:
            raise ValueError(
                f"tenants {reserved} are names the services keep for their own requests (the gateway "
                "refuses tokens of such a tenant); rename them"
            )
        tenants = {
            name: _limits(defaults, dict(entry), f"tenant {name!r}")
            for name, entry in dict(document.get("tenants", {})).items()
        }
        return cls(defaults=defaults, tenants=tenants)

    @classmethod
    def load(cls, path: Path) -> TenantTable:
        """Reads and validates a tenants file."""
        return load_policy_file(path, "tenant table", cls.from_dict)

    def limits(self, tenant: str) -> TenantLimits:
        """The limits that apply to `tenant`."""
        return self.tenants.get(tenant, self.defaults)

    @property
    def has_safety_overrides(self) -> bool:
        """True when the defaults or any tenant turn off or loosen a safety category."""
        return any(not limits.safety.is_empty for limits in [self.defaults, *self.tenants.values()])

    def check_against_gate(self, categories: Mapping[str, GateCategory], gate_version: str) -> list[str]:
        """ValueError naming the tenant and field when a safety override names a category the gate
        lacks, or sets a threshold that loosens no surface (below the gate's own on each); returns
        a warning per threshold that loosens only some surfaces (the others keep the gate's)."""
        warnings = []
        for where, limits in [
            ("defaults", self.defaults),
            *((f"tenant {n!r}", t) for n, t in self.tenants.items()),
        ]:
            warnings += _check_overrides(where, limits.safety, categories, gate_version)
        return warnings


def _check_overrides(
    where: str, safety: SafetyOverrides, categories: Mapping[str, GateCategory], gate_version: str
) -> list[str]:
    unknown = sorted(safety.categories - set(categories))
    if unknown:
        raise ValueError(
            f"{where}: safety names {unknown}, which gate {gate_version} does not have; "
            f"its categories: {sorted(categories)}"
        )
    warnings = []
    for name, value in sorted(safety.thresholds.items()):
        gate = categories[name].thresholds
        kept = {surface: t for surface, t in gate.items() if value < t}
        own = ", ".join(f"{surface} {t:.4f}" for surface, t in gate.items())
        field = f"{where}: safety.thresholds.{name} = {value:g}"
        if len(kept) == len(gate):
            raise ValueError(
                f"{field} is below gate {gate_version}'s own threshold on every surface ({own}), so "
                f"it would loosen nothing; a tenant may only loosen a category: use a value in "
                f"[{max(gate.values()):.4f}, 1], or put it in safety.categories_off"
            )
        if kept:
            warnings.append(
                f"{field} loosens only some surfaces; gate {gate_version}'s own threshold applies on "
                f"{', '.join(kept)} ({own})"
            )
    return warnings


def is_valid_tenant(tenant: str) -> bool:
    """Whether a tenant id is safe to use as a Redis key part, cache salt and log field."""
    return _TENANT.fullmatch(tenant) is not None  # fullmatch: `$` would let a trailing newline in
