"""One gateway, two safety processes: a target of several addresses spreads the checks over them."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli.mesh import Mesh, MeshConfig, Ports
from services.common.ports import free_port
from tests.gateway.conftest import call, token


@pytest.fixture(scope="module")
def mesh(stories_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Redis, an engine, and two safety processes on the mesh's token."""
    settings = {"THERMOCLINE_ENGINE_KVSTORE_TARGET": ""}  # no kvstore: no cold tier
    mesh = Mesh(
        MeshConfig(str(stories_model), tmp_path_factory.mktemp("safety-replicas"), Ports.free(), env=settings)
    )
    mesh.logs_dir.mkdir(parents=True, exist_ok=True)
    mesh.extra_ports["safety-2"] = free_port()
    try:
        for service in ("redis", "safety", "safety-2", "engine"):
            mesh.start_service(service)
        yield mesh
    finally:
        mesh.stop()


def _checks(mesh: Mesh, service: str) -> float:
    """Every check the safety process `service` has answered, prompts and outputs."""
    with urllib.request.urlopen(mesh.metrics_url(service), timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("thermocline_safety_checks_total{")
    )


def test_a_safety_target_of_two_addresses_spreads_the_checks_over_both(mesh: Mesh) -> None:
    both = f"ipv4:{mesh.target('safety')},{mesh.target('safety-2')}"
    gateway = mesh.start_gateway_replica("gateway-two-safety", THERMOCLINE_GATEWAY_SAFETY_TARGET=both)
    bearer = token(mesh)
    before = {name: _checks(mesh, name) for name in ("safety", "safety-2")}
    for _ in range(6):
        assert call(gateway, bearer, max_tokens=4).done is not None
    after = {name: _checks(mesh, name) for name in ("safety", "safety-2")}
    answered = {name: after[name] - before[name] for name in after}
    # each call is a prompt check and at least one output check, taken by the two in turn
    assert sum(answered.values()) >= 12, answered
    assert min(answered.values()) >= 3, answered
