"""Per-class SLAs (p99 limits) and the knee: the highest load at which a class stays inside its SLA."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from services.cli.loadgen.stats import ClassSummary

METRICS = ("ttft", "tpot", "e2e")
PASS, FAIL, NO_DATA = "pass", "fail", "no-data"


class Verdict(NamedTuple):
    """Whether one class met its SLA at one load level, and why not."""

    status: str
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sla:
    """p99 limits in ms for any of TTFT, time per output token and end-to-end latency, and the
    largest share of failed requests (any non-OK status) the class tolerates."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    max_error_rate: float = 0.01

    def __post_init__(self) -> None:
        limits = self.limits
        if not limits:
            raise ValueError("an SLA needs at least one of ttft_ms, tpot_ms, e2e_ms")
        if any(not (v > 0 and math.isfinite(v)) for v in limits.values()):
            raise ValueError(f"SLA limits must be positive numbers of ms, got {limits}")
        if not 0.0 <= self.max_error_rate <= 1.0:
            raise ValueError(f"max_error_rate must lie in [0, 1], got {self.max_error_rate}")

    @property
    def limits(self) -> dict[str, float]:
        """metric → p99 limit in ms, for the metrics this SLA bounds."""
        values = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2e": self.e2e_ms}
        return {metric: limit for metric, limit in values.items() if limit is not None}

    def check(self, summary: ClassSummary) -> Verdict:
        """Pass when the error rate and every bounded p99 are within limits; no-data when nothing was sent."""
        if summary.num_sent == 0:
            return Verdict(NO_DATA)
        reasons = []
        if summary.error_rate > self.max_error_rate:
            reasons.append(f"error rate {summary.error_rate:.3f} > {self.max_error_rate:.3f}")
        for metric, limit_ms in self.limits.items():
            latency = summary.latency(metric)
            if latency is not None and latency.p99_ms > limit_ms:
                reasons.append(f"{metric} p99 {latency.p99_ms:.0f} ms > {limit_ms:.0f} ms")
        return Verdict(FAIL, tuple(reasons)) if reasons else Verdict(PASS)

    def to_json(self) -> dict[str, float]:
        """The report's form."""
        return {f"{metric}_p99_ms": limit for metric, limit in self.limits.items()} | {
            "max_error_rate": self.max_error_rate
        }


SLA_KEYS = {"ttft_ms", "tpot_ms", "e2e_ms", "max_error_rate"}


def parse_sla_table(table: dict[str, Any], where: str) -> Sla:
    """An SLA from a workload file's `sla = {ttft_ms = ..., ...}`."""
    if unknown := set(table) - SLA_KEYS:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(SLA_KEYS)}")
    try:
        return Sla(**{key: float(value) for key, value in table.items()})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def parse_sla_flag(text: str) -> tuple[str, Sla]:
    """`INTENT:ttft_ms=2000,e2e_ms=15000` → (intent, Sla)."""
    intent, sep, body = text.partition(":")
    if not sep or not intent.strip() or not body.strip():
        raise ValueError(f"--sla {text!r} is not INTENT:KEY=MS[,KEY=MS...] (e.g. default:ttft_ms=2000)")
    table = {}
    for item in body.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq:
            raise ValueError(f"--sla {text!r}: {item!r} is not KEY=VALUE")
        table[key.strip()] = value.strip()
    return intent.strip(), parse_sla_table(table, f"--sla {intent.strip()}")


def find_knee(loads: Sequence[float], statuses: Sequence[str]) -> float | None:
    """The highest load that passed before the first failing one, in increasing load order.

    Levels without data neither pass nor break the run of passes. A pass above a failure is not
    counted: latency that recovers at a higher load is noise or warm-up, not headroom.
    """
    knee = None
    for load, status in sorted(zip(loads, statuses, strict=True)):
        if status == FAIL:
            break
        if status == PASS:
            knee = load
    return knee
