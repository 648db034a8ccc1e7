"""Faults under a real mesh: an engine that restarts, and an audit disk that fills up."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.mesh import Mesh, free_port
from services.cli.trace_collector import TraceCollector
from tests.conftest import start_mesh
from tests.gateway.conftest import call, fill, gauge_value, refusal, token


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    started = start_mesh(stories_model, tmp_path_factory.mktemp("faults-mesh"), collector)
    yield started
    started.stop()


def _unwritable_s(metrics_port: int) -> float:
    return gauge_value(metrics_port, "thermocline_gateway_audit_unwritable_seconds")


def _calls_until_refused(target: str, bearer: str) -> int:
    """Calls until one is refused; how many were served before it."""
    for num_served in range(64):
        try:
            call(target, bearer, max_tokens=1)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            return num_served
    raise AssertionError("64 calls were served on a full disk")


def test_a_full_audit_disk_refuses_calls_and_loses_no_acknowledged_event(
    mesh: Mesh, small_disk: Path
) -> None:
    metrics_port = free_port()
    audit_dir = small_disk / "audit"
    target = mesh.start_gateway_replica(
        "gateway-small-disk",
        THERMOCLINE_GATEWAY_AUDIT_DIR=str(audit_dir),
        THERMOCLINE_GATEWAY_METRICS_PORT=str(metrics_port),
    )
    bearer = token(mesh)
    try:
        assert call(target, bearer, max_tokens=1).done is not None
        filler = fill(small_disk)
        num_served = 1 + _calls_until_refused(target, bearer)  # the segment's last page had room left
        error = refusal(target, bearer, max_tokens=1)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "audit log cannot be written (No space left on device)" in error.details()
        assert _unwritable_s(metrics_port) > 0
        filler.unlink()
        assert call(target, bearer, max_tokens=1).done is not None
        assert _unwritable_s(metrics_port) == 0
    finally:
        process = mesh.processes.pop("gateway-small-disk")
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    verify = [sys.executable, "-m", "services.cli.main", "audit", "verify", str(audit_dir)]
    done = subprocess.run([*verify, "--key-file", str(mesh.audit_key_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # every served call, and none of the refused ones
    assert f"decisions: {num_served + 1} events" in done.stdout


def test_a_restarted_engine_serves_through_the_gateway_once_it_reports_serving(mesh: Mesh) -> None:
    bearer = token(mesh)
    assert call(mesh.target("gateway"), bearer, max_tokens=1).done is not None
    mesh.processes["engine"].send_signal(signal.SIGKILL)
    mesh.processes["engine"].wait(30)
    down = refusal(mesh.target("gateway"), bearer, max_tokens=1)
    assert down.code() == grpc.StatusCode.UNAVAILABLE
    mesh.start_service("engine")  # returns once the new engine's health Watch says SERVING
    # gRPC's default reconnect backoff kept the gateway answering UNAVAILABLE for seconds more
    assert call(mesh.target("gateway"), bearer, max_tokens=1).done is not None
