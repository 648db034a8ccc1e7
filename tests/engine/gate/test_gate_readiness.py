"""Whether a replica should get traffic, by its gate: not while the gate refuses every Generate, and
again once the re-check finds safety announcing the gate the engine holds; in process, then as a
real engine's health for the readiness probe's name."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.mesh import Mesh
from services.engine.gate.gate_loader import MismatchPolicy
from tests.engine.gate.test_gate_watch import (
    _announce,
    _generate_code,
    _recheck,
    _restart_safety,
    _safety_and_engine,
    _stories_gate,
    _watch,
)
from tests.engine.gate.test_safety_gate import _random_gate
from tests.health import watch_until


@pytest.fixture
def gates(tmp_path: Path) -> tuple[Path, Path]:
    """Two gates for the tiny model that differ in their weights."""
    first = _random_gate(tmp_path / "a.safetensors", 64, seed=0)
    return first, _random_gate(tmp_path / "b.safetensors", 64, seed=1)


def test_a_refusing_gate_is_a_readiness_problem_until_the_recheck_lifts_it(gates: tuple[Path, Path]) -> None:
    held, other = gates
    watch = _watch(held, _announce(held))
    assert watch.readiness_problem() is None

    _recheck(watch, _announce(other))  # safety redeployed with another gate
    problem = watch.readiness_problem()
    assert problem is not None and "refuses every Generate" in problem
    assert _announce(other).sha256 in problem  # the report's detail: which gate safety wants

    _recheck(watch, None)  # safety does not answer: the refusal, and the problem, stay
    assert watch.readiness_problem() == problem

    _recheck(watch, _announce(held))  # safety announces the held gate again
    assert watch.readiness_problem() is None


def test_a_mismatch_under_the_warn_policy_serves_and_is_ready(gates: tuple[Path, Path]) -> None:
    held, other = gates
    watch = _watch(held, _announce(other), mismatch=MismatchPolicy.WARN)
    assert watch.loaded.report.status.name == "MISMATCH" and watch.readiness_problem() is None


# --- a real engine against a real safety service -------------------------------------------------

ENGINE_SERVICE = "thermocline.engine.v1.EngineService"


def _health(mesh: Mesh, service: str) -> int:
    """The engine's health status for `service` ("": the server, the liveness probe's name)."""
    with mesh.channel("engine") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return reply.status  # type: ignore[no-any-return]


def _wait_for_health(mesh: Mesh, service: str, status: int, timeout_s: float = 60) -> None:
    """Follows the engine's health Watch stream for `service` until it says `status`."""
    with mesh.channel("engine") as channel:
        if watch_until(channel, service, status, timeout_s):
            return
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    raise AssertionError(f"{service!r} not {name} after {timeout_s} s\n{mesh.log_tail('engine')}")


def test_a_refusing_engine_is_live_but_not_ready_until_safety_announces_its_gate(
    stories_model: Path, tmp_path: Path
) -> None:
    """The readiness probe's name (the engine service) is NOT_SERVING while the gate refuses; the
    liveness probe's ("") stays SERVING, and the re-check that lifts the refusal makes it ready."""
    gate_a, gate_b = (
        _stories_gate(tmp_path / "a.safetensors", "a"),
        _stories_gate(tmp_path / "b.safetensors", "b"),
    )
    mesh = _safety_and_engine(
        tmp_path / "mesh", stories_model, gate_b, THERMOCLINE_ENGINE_GATE_FILE=str(gate_a)
    )
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        assert (_health(mesh, ""), _health(mesh, ENGINE_SERVICE)) == (serving, not_serving)
        assert _generate_code(mesh) == grpc.StatusCode.FAILED_PRECONDITION  # still reachable

        _restart_safety(mesh, gate_a)  # the operator deploys the engine's gate to safety
        _wait_for_health(mesh, ENGINE_SERVICE, serving)
        assert _health(mesh, "") == serving
        assert _generate_code(mesh) == grpc.StatusCode.OK
    finally:
        mesh.stop()
