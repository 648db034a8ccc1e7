"""Refusals of callers with no verified identity, past the audit rate: counted, then summarised.

A real gateway whose audit rate for unauthenticated refusals is one event now and then none for
the length of the test: the first refusal is written, the next ones are only counted, every caller
still gets its UNAUTHENTICATED answer, and stopping the gateway writes one summary event with the
counts. The chain still verifies."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from services.cli.trace_collector import TraceCollector
from services.gateway.audit import STREAMS
from services.gateway.audit_chain import segment_paths
from services.gateway.audit_sampling import (
    MAX_TRACKED_REASONS,
    SUMMARY_ACTION,
    TENANT_SUMMARY_ACTION,
    DenialSampler,
)
from services.gateway.audit_verify import verify_directory
from tests.conftest import start_mesh
from tests.gateway.conftest import call, refusal, token

NUM_LEFT_OUT = 20


def _decisions(audit_dir: Path) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for path in segment_paths(audit_dir, "decisions")
        for line in path.read_text().splitlines()
    ]


def test_refusals_that_cost_nothing_over_the_rate_are_counted_and_summarised_at_stop(
    stories_model: Path, collector: TraceCollector, tmp_path: Path
) -> None:
    # 0.001 events/s: a bucket of one event, refilled once in ~17 minutes. Tenant "metered" has one
    # request in its bucket, refilled as slowly: its later calls are refused for its rate limit.
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"metered": {"requests_per_s": 0.001, "burst_requests": 1}}}))
    mesh = start_mesh(
        stories_model,
        tmp_path / "mesh",
        collector,
        THERMOCLINE_GATEWAY_AUDIT_UNAUTHENTICATED_PER_S="0.001",
        THERMOCLINE_GATEWAY_AUDIT_FREE_REFUSALS_PER_S="0.001",
        THERMOCLINE_GATEWAY_TENANTS_FILE=str(tenants),
    )
    metered = token(mesh, subject="metered-user", tenant="metered")
    try:
        target = mesh.target("gateway")
        first = refusal(target, "not-a-jwt")
        assert first.code() == grpc.StatusCode.UNAUTHENTICATED
        for n in range(NUM_LEFT_OUT):
            bearer = "not-a-jwt" if n % 2 else None  # two reasons
            assert refusal(target, bearer).code() == grpc.StatusCode.UNAUTHENTICATED
        assert call(target, token(mesh)).done is not None  # callers with a token are not affected
        during = [e for e in _decisions(mesh.audit_dir) if e["actor_principal"] == "unauthenticated"]
        assert len(during) == 1  # the first refusal only
        assert call(target, metered).done is not None  # its one request
        for _ in range(NUM_LEFT_OUT + 1):  # refused for its rate: the first written, then counted
            assert refusal(target, metered).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        limited = [
            e for e in _decisions(mesh.audit_dir) if e["tenant"] == "metered" and e["decision"] == "deny"
        ]
        assert len(limited) == 1
    finally:
        mesh.stop()
    events = [e for e in _decisions(mesh.audit_dir) if e["actor_principal"] == "unauthenticated"]
    (summary,) = [e for e in events if e["action"] == SUMMARY_ACTION]
    details = summary["details"]
    assert isinstance(details, dict) and details["refusals"] == NUM_LEFT_OUT
    assert sum(details["by_reason"].values()) == NUM_LEFT_OUT and len(details["by_reason"]) == 2
    (tenant_summary,) = [e for e in _decisions(mesh.audit_dir) if e["action"] == TENANT_SUMMARY_ACTION]
    assert tenant_summary["tenant"] == "metered" and tenant_summary["details"]["refusals"] == NUM_LEFT_OUT
    report = verify_directory(mesh.audit_dir, STREAMS)
    assert report.is_ok, report.problems


@pytest.mark.parametrize("per_s", ["-1", "x"])
def test_a_bad_unauthenticated_audit_rate_is_refused_at_start(per_s: str) -> None:
    from services.gateway.config import _audit_from_env

    with pytest.raises(ValueError, match="AUDIT_UNAUTHENTICATED_PER_S"):
        _audit_from_env({"THERMOCLINE_GATEWAY_AUDIT_UNAUTHENTICATED_PER_S": per_s})


def test_the_bucket_refills_at_its_rate_and_a_zero_rate_writes_every_refusal() -> None:
    now = [0.0]
    denials = DenialSampler("", per_s=2.0, burst=3, clock=lambda: now[0])
    assert [denials.admit() for _ in range(4)] == [True, True, True, False]
    now[0] = 1.0  # two more
    assert [denials.admit() for _ in range(3)] == [True, True, False]
    for reason in ("bad token", "bad token", "no token"):
        denials.count(reason, "2026-12-07T00:00:00.000Z")
    summary = denials.summary()
    assert summary is not None and summary.details["by_reason"] == {"bad token": 2, "no token": 1}
    assert denials.summary() is not None  # not written yet (a full disk): the counts stay
    denials.count("no token", "2026-12-07T00:00:01.000Z")  # counted while the summary was written
    denials.written()
    again = denials.summary()
    assert again is not None and again.details["by_reason"] == {"no token": 1}
    denials.written()
    assert denials.summary() is None
    every = DenialSampler("", per_s=0.0)
    assert all(every.admit() for _ in range(10_000))


def test_reasons_a_caller_makes_up_are_tracked_apart_only_up_to_a_bound() -> None:
    denials = DenialSampler("", per_s=1.0)
    for n in range(MAX_TRACKED_REASONS + 50):  # each bad token's header quoted differently
        denials.count(f"token typ 'x{n}' refused", "2026-12-07T00:00:00.000Z")
    summary = denials.summary()
    assert summary is not None and summary.details["refusals"] == MAX_TRACKED_REASONS + 50
    assert denials.num_reasons == MAX_TRACKED_REASONS + 1  # the bound, and "(other reasons)"
