"""Whether a replica should get traffic, by its gate: not while the gate refuses every Generate, and
again once the re-check finds safety announcing the gate the engine holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.gate.gate_loader import MismatchPolicy
from tests.engine.gate.test_gate_watch import _announce, _recheck, _watch
from tests.engine.gate.test_safety_gate import _random_gate


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
