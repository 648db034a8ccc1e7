"""One gateway, two safety processes: a target of several addresses spreads the checks over them."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.cli.mesh import Mesh, MeshConfig, Ports
from services.common.ports import free_port
from services.gateway.config import RoutingConfig
from services.gateway.router import Router
from services.gateway.upstream import Upstreams
from tests.conftest import holding_service_token
from tests.gateway.conftest import call, token
from thermocline.safety.v1 import safety_pb2, safety_pb2_grpc


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


class _Draining(safety_pb2_grpc.SafetyServiceServicer):
    """A safety process on its way down: it still accepts calls, and answers each UNAVAILABLE."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def CheckOutput(
        self, request: safety_pb2.CheckOutputRequest, context: Any
    ) -> safety_pb2.CheckResponse:
        self.num_calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        raise AssertionError("abort returns no answer")


def _checks(mesh: Mesh, service: str) -> float:
    """Every check the safety process `service` has answered, prompts and outputs."""
    with urllib.request.urlopen(mesh.metrics_url(service), timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("thermocline_safety_checks_total{")
    )


@pytest.fixture(scope="module")
def gateway(mesh: Mesh) -> str:
    """A gateway whose safety target names both safety processes."""
    both = f"ipv4:{mesh.target('safety')},{mesh.target('safety-2')}"
    return mesh.start_gateway_replica("gateway-two-safety", THERMOCLINE_GATEWAY_SAFETY_TARGET=both)


def test_a_safety_target_of_two_addresses_spreads_the_checks_over_both(mesh: Mesh, gateway: str) -> None:
    bearer = token(mesh)
    before = {name: _checks(mesh, name) for name in ("safety", "safety-2")}
    for _ in range(6):
        assert call(gateway, bearer, max_tokens=4).done is not None
    after = {name: _checks(mesh, name) for name in ("safety", "safety-2")}
    answered = {name: after[name] - before[name] for name in after}
    # each call is a prompt check and at least one output check, taken by the two in turn
    assert sum(answered.values()) >= 12, answered
    assert min(answered.values()) >= 3, answered


def test_with_one_safety_process_killed_every_call_is_screened_by_the_other(mesh: Mesh, gateway: str) -> None:
    bearer = token(mesh)
    process = mesh.processes.pop("safety-2")
    process.kill()  # a crash: no drain, its connections reset by the kernel
    process.wait(60)
    before = _checks(mesh, "safety")
    # the first check may still be sent to the dead one: UNAVAILABLE, sent again to the other
    for _ in range(6):
        assert call(gateway, bearer, max_tokens=4).done is not None
    assert _checks(mesh, "safety") - before >= 12


def test_a_check_a_safety_process_answers_unavailable_is_sent_to_the_next(mesh: Mesh) -> None:
    # gRPC's transparent retry covers a call that never reached a process; this one reached it
    async def scenario() -> tuple[list[int], int]:
        draining = _Draining()
        server = grpc.aio.server()
        safety_pb2_grpc.add_SafetyServiceServicer_to_server(draining, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        target = f"ipv4:127.0.0.1:{port},{mesh.target('safety')}"
        with holding_service_token(mesh.service_token_path):
            upstreams = Upstreams(Router(RoutingConfig(engine_targets=(mesh.target("engine"),))), target)
        try:
            no_policy = safety_pb2.TenantPolicy()
            replies = [
                await upstreams.check_output(
                    f"Once upon a time there was a cat number {n}.", "", "acme", no_policy, 30
                )
                for n in range(6)
            ]
        finally:
            await upstreams.close()
            await server.stop(None)
        return [reply.decision for reply in replies], draining.num_calls

    decisions, num_unavailable = asyncio.run(scenario())
    assert decisions == [safety_pb2.DECISION_ALLOW] * 6
    assert num_unavailable >= 1  # round_robin sent some of them to the draining process first
