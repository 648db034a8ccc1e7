"""Runs the levels of a run in increasing load and judges each against the classes' SLAs."""

from __future__ import annotations

from collections.abc import Sequence

from services.cli.loadgen.gateway_client import GatewayLoadClient
from services.cli.loadgen.report import LevelResult, level_verdicts
from services.cli.loadgen.runner import LevelSpec, RequestSource, run_level
from services.cli.loadgen.sla import FAIL, Sla
from services.cli.loadgen.stats import summarize_level
from services.cli.loadgen.workload import PlannedRequest, Workload


async def run_levels(
    client: GatewayLoadClient,
    specs: Sequence[LevelSpec],
    *,
    workload: Workload | None,
    trace: Sequence[PlannedRequest] | None,
    slas: dict[str, Sla],
    seed: int,
    stop_when_all_fail: bool = True,
    show_progress: bool = True,
) -> list[LevelResult]:
    """Each level in order of load; with `stop_when_all_fail`, stops after the first level at which
    every SLA'd class failed (higher loads can only be worse, and overload runs are slow)."""
    intents = list(workload.shares) if workload is not None else sorted({r.intent for r in trace or []})
    results = []
    for spec in sorted(specs, key=lambda s: s.load):
        source = RequestSource(spec, workload, trace, seed)
        run = await run_level(client, source, show_progress)
        summary = summarize_level(run.records, run.wall_s, intents)
        results.append(LevelResult(spec.mode, spec.load, summary, level_verdicts(summary, slas)))
        verdicts = results[-1].verdicts
        all_failed = bool(verdicts) and all(v.status == FAIL for v in verdicts.values())
        if stop_when_all_fail and all_failed:
            break
    return results
