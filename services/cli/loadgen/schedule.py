"""Arrival times for open-loop runs: a Poisson process, or a trace's own times rescaled to a rate."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from services.cli.loadgen.workload import PlannedRequest, Workload


def poisson_offsets(
    rate_per_s: float, rng: random.Random, *, num_requests: int | None = None, duration_s: float | None = None
) -> list[float]:
    """Arrival offsets (s) of a Poisson process: exponential gaps with mean 1/rate.

    Stops after `num_requests` arrivals or at the last arrival before `duration_s`, whichever is given
    (exactly one must be).
    """
    if rate_per_s <= 0:
        raise ValueError(f"the arrival rate must be > 0 requests/s, got {rate_per_s}")
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    offsets: list[float] = []
    now = 0.0
    while num_requests is None or len(offsets) < num_requests:
        now += rng.expovariate(rate_per_s)
        if duration_s is not None and now >= duration_s:
            break
        offsets.append(now)
    return offsets


def open_loop_plan(
    workload: Workload,
    rate_per_s: float,
    arrival_rng: random.Random,
    request_rng: random.Random,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[PlannedRequest]:
    """Requests drawn from the workload at Poisson arrival times.

    Arrivals and requests come from separate generators, so that two levels seeded alike send the
    same requests in the same order, the faster level with every gap shrunk by the ratio of the
    rates (common random numbers: the levels differ in load only, not in luck of the draw).
    """
    offsets = poisson_offsets(rate_per_s, arrival_rng, num_requests=num_requests, duration_s=duration_s)
    return [replace(workload.draw(request_rng), offset_s=offset) for offset in offsets]


def trace_rate_per_s(trace: Sequence[PlannedRequest]) -> float | None:
    """The trace's mean arrival rate; None when all its requests arrive at once."""
    span_s = max(r.offset_s or 0.0 for r in trace)
    return (len(trace) - 1) / span_s if len(trace) > 1 and span_s > 0 else None


def rescale_trace(trace: Sequence[PlannedRequest], rate_per_s: float | None) -> list[PlannedRequest]:
    """The trace with its gaps stretched or squeezed so that its mean rate is `rate_per_s`
    (unchanged when `rate_per_s` is None or the trace has no rate)."""
    native = trace_rate_per_s(trace)
    if rate_per_s is None or native is None:
        return list(trace)
    factor = native / rate_per_s
    return [replace(r, offset_s=(r.offset_s or 0.0) * factor) for r in trace]
