"""The run's outputs: a JSON document (schema in services/cli/loadgen_schema.json) and markdown tables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.cli.loadgen.runner import OPEN
from services.cli.loadgen.sla import Sla, Verdict, find_knee
from services.cli.loadgen.stats import ClassSummary, LatencySummary, LevelSummary

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class LevelResult:
    """One level's load, summary and SLA verdicts."""

    mode: str
    load: float
    summary: LevelSummary
    verdicts: dict[str, Verdict] = field(default_factory=dict)


def level_verdicts(summary: LevelSummary, slas: dict[str, Sla]) -> dict[str, Verdict]:
    """Each SLA'd class's verdict at this level."""
    return {
        intent: sla.check(summary.classes[intent])
        for intent, sla in slas.items()
        if intent in summary.classes
    }


def knees(levels: list[LevelResult], slas: dict[str, Sla]) -> dict[str, float | None]:
    """Each SLA'd class's knee over the levels."""
    loads = [level.load for level in levels]
    return {intent: find_knee(loads, [level.verdicts[intent].status for level in levels]) for intent in slas}


def _latency_json(latency: LatencySummary | None) -> dict[str, float | int] | None:
    return None if latency is None else latency.to_json()


def class_json(summary: ClassSummary) -> dict[str, Any]:
    """One class's counts, latencies and throughput."""
    return {
        "sent": summary.num_sent,
        "succeeded": summary.num_succeeded,
        "failed": summary.num_failed,
        "failed_by_status": summary.failed_by_status,
        "first_errors": summary.first_errors,
        "finish_reasons": summary.finish_reasons,
        "prompt_tokens": summary.num_prompt_tokens,
        "output_tokens": summary.num_output_tokens,
        "requests_per_s": summary.requests_per_s,
        "output_tokens_per_s": summary.output_tokens_per_s,
        "ttft_ms": _latency_json(summary.ttft),
        "tpot_ms": _latency_json(summary.tpot),
        "e2e_ms": _latency_json(summary.e2e),
    }


def level_json(level: LevelResult) -> dict[str, Any]:
    """One level of the report."""
    summary = level.summary
    return {
        "mode": level.mode,
        "load": level.load,
        "load_unit": "requests_per_s" if level.mode == OPEN else "concurrent_clients",
        "wall_s": summary.wall_s,
        "max_send_lag_ms": summary.max_send_lag_ms,
        "overall": class_json(summary.overall),
        "classes": {intent: class_json(s) for intent, s in summary.classes.items()},
        "sla": {
            intent: {"status": v.status, "reasons": list(v.reasons)} for intent, v in level.verdicts.items()
        },
    }


def report_json(settings: dict[str, Any], levels: list[LevelResult], slas: dict[str, Sla]) -> dict[str, Any]:
    """The whole JSON document."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "thermocline loadgen",
        "settings": settings,
        "slas": {intent: sla.to_json() for intent, sla in slas.items()},
        "levels": [level_json(level) for level in levels],
        "knees": knees(levels, slas),
    }


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _triple(latency: LatencySummary | None) -> str:
    if latency is None:
        return "–"
    return " / ".join(_ms(v) for v in (latency.p50_ms, latency.p90_ms, latency.p99_ms))


def _failures(summary: ClassSummary) -> str:
    return ", ".join(f"{status} {n}" for status, n in summary.failed_by_status.items()) or "0"


def levels_markdown(levels: list[LevelResult]) -> str:
    """One row per level and class: counts, p50/p90/p99 latencies, throughput, SLA verdict."""
    unit = "req/s" if levels and levels[0].mode == OPEN else "clients"
    lines = [
        f"| load ({unit}) | class | sent | ok | failed | TTFT ms p50/p90/p99 | TPOT ms p50/p90/p99 "
        "| E2E ms p50/p90/p99 | ok req/s | out tok/s | SLA |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for level in levels:
        rows = [*level.summary.classes.items(), ("all", level.summary.overall)]
        for intent, s in rows:
            verdict = level.verdicts.get(intent)
            sla = (
                ""
                if verdict is None
                else verdict.status + (f" ({'; '.join(verdict.reasons)})" if verdict.reasons else "")
            )
            lines.append(
                f"| {level.load:g} | {intent} | {s.num_sent} | {s.num_succeeded} | {_failures(s)} "
                f"| {_triple(s.ttft)} | {_triple(s.tpot)} | {_triple(s.e2e)} "
                f"| {s.requests_per_s:.2f} | {s.output_tokens_per_s:.1f} | {sla} |"
            )
    return "\n".join(lines)


def knees_markdown(levels: list[LevelResult], slas: dict[str, Sla]) -> str:
    """One row per SLA'd class: its limits and its knee."""
    unit = "req/s" if levels and levels[0].mode == OPEN else "clients"
    found = knees(levels, slas)
    lines = [f"| class | SLA (p99 limits, max error rate) | knee ({unit}) |", "| --- | --- | --- |"]
    for intent, sla in slas.items():
        limits = ", ".join(f"{metric} ≤ {limit:g} ms" for metric, limit in sla.limits.items())
        knee_text = _knee_text(found[intent], [level.load for level in levels])
        lines.append(f"| {intent} | {limits}, errors ≤ {sla.max_error_rate:g} | {knee_text} |")
    return "\n".join(lines)


def _knee_text(knee: float | None, loads: list[float]) -> str:
    if knee is None:
        return f"below {min(loads):g} (the lowest level failed)"
    if knee == max(loads):
        return f"≥ {knee:g} (the highest level run passed: raise the sweep)"
    return f"{knee:g}"


def report_markdown(levels: list[LevelResult], slas: dict[str, Sla]) -> str:
    """The levels table, then the knees when there are SLAs."""
    parts = ["## Load levels", "", levels_markdown(levels)]
    if slas:
        parts += ["", "## Knee: the highest load inside each class's SLA", "", knees_markdown(levels, slas)]
    return "\n".join(parts) + "\n"
