"""Latency percentiles, throughput and error counts of a run, overall and per intent class."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from services.cli.loadgen.record import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles of one latency over the successful requests, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    def to_json(self) -> dict[str, float | int]:
        """The report's form."""
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("no values to take a percentile of")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize_latency(values_s: Sequence[float]) -> LatencySummary | None:
    """p50/p90/p99 and mean in ms; None when there is nothing to summarise."""
    if not values_s:
        return None
    values_ms = [v * 1000.0 for v in values_s]
    p50, p90, p99 = (percentile(values_ms, q) for q in PERCENTILES)
    return LatencySummary(len(values_ms), float(np.mean(values_ms)), p50, p90, p99)


@dataclass(frozen=True)
class ClassSummary:
    """Counts, latencies and throughput of one class (or of all requests together)."""

    num_sent: int
    num_succeeded: int
    failed_by_status: dict[str, int]
    finish_reasons: dict[str, int]
    ttft: LatencySummary | None
    tpot: LatencySummary | None
    e2e: LatencySummary | None
    num_prompt_tokens: int
    num_output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    first_errors: dict[str, str] = field(default_factory=dict)

    @property
    def num_failed(self) -> int:
        """Requests that ended with a status other than OK."""
        return sum(self.failed_by_status.values())

    @property
    def error_rate(self) -> float:
        """Failed / sent (0 when nothing was sent)."""
        return self.num_failed / self.num_sent if self.num_sent else 0.0

    def latency(self, metric: str) -> LatencySummary | None:
        """`ttft`, `tpot` or `e2e`."""
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}[metric]


def summarize_class(records: Sequence[RequestRecord], wall_s: float) -> ClassSummary:
    """The summary of `records`, with rates over `wall_s` seconds."""
    ok = [r for r in records if r.is_ok]
    failed = Counter(r.status for r in records if not r.is_ok)
    first_errors: dict[str, str] = {}
    for record in records:
        if not record.is_ok and record.status not in first_errors:
            first_errors[record.status] = record.error or ""
    num_output_tokens = sum(r.num_output_tokens for r in ok)
    return ClassSummary(
        num_sent=len(records),
        num_succeeded=len(ok),
        failed_by_status=dict(sorted(failed.items())),
        finish_reasons=dict(sorted(Counter(r.finish_reason or "unknown" for r in ok).items())),
        ttft=summarize_latency([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=summarize_latency([t for r in ok if (t := r.tpot_s) is not None]),
        e2e=summarize_latency([r.e2e_s for r in ok]),
        num_prompt_tokens=sum(r.num_prompt_tokens for r in ok),
        num_output_tokens=num_output_tokens,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        output_tokens_per_s=num_output_tokens / wall_s if wall_s > 0 else 0.0,
        first_errors=first_errors,
    )


@dataclass(frozen=True)
class LevelSummary:
    """One load level: all requests together and each class alone."""

    overall: ClassSummary
    classes: dict[str, ClassSummary]
    wall_s: float
    max_send_lag_ms: float


def summarize_level(records: Sequence[RequestRecord], wall_s: float, intents: Sequence[str]) -> LevelSummary:
    """Summaries for every class in `intents` (a class that got no request shows zeros)."""
    by_intent: dict[str, list[RequestRecord]] = {intent: [] for intent in intents}
    for record in records:
        by_intent.setdefault(record.intent, []).append(record)
    return LevelSummary(
        overall=summarize_class(records, wall_s),
        classes={intent: summarize_class(rs, wall_s) for intent, rs in by_intent.items()},
        wall_s=wall_s,
        max_send_lag_ms=max((r.send_lag_s for r in records), default=0.0) * 1000.0,
    )
