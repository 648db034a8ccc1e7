"""The router against a real engine whose safety gate comes to differ from the safety service's:
live but not ready, and still routed to while no replica is ready, so the caller gets the engine's
FAILED_PRECONDITION that names the gate instead of UNAVAILABLE. Beside a ready replica, the calls
any replica can answer (GetModelInfo, CountTokens) go to the ready one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.mesh import Mesh, MeshConfig, Ports
from services.gateway.config import RoutingConfig
from services.gateway.router import Router
from services.gateway.upstream import Upstreams
from tests.conftest import STORIES_PROMPT, STORIES_PROMPT_IDS, holding_service_token
from tests.engine.gate.test_gate_watch import _restart_safety, _safety_and_engine, _stories_gate
from tests.gateway.test_router import _wait_until
from tests.http.test_prompt_count import engine_counts_served
from thermocline.engine.v1 import engine_pb2

WAIT_S = 60.0  # the engine re-checks safety's gate twice a second; safety restarts in seconds


async def _generate_error(router: Router) -> grpc.aio.AioRpcError:
    """The error of one short Generate to the replica the router puts first."""
    (replica,) = router.candidates(b"any prefix", "interactive")
    request = engine_pb2.GenerateRequest(
        prompt="Once upon a time", sampling=engine_pb2.SamplingParams(max_tokens=4)
    )
    try:
        [_ async for _ in replica.stub.Generate(request, timeout=WAIT_S)]
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the refusing engine served the request")


def test_an_engine_that_turns_refusing_is_live_not_ready_and_still_routed_to(
    stories_model: Path, tmp_path: Path
) -> None:
    gate_a = _stories_gate(tmp_path / "a.safetensors", "a")
    gate_b = _stories_gate(tmp_path / "b.safetensors", "b")
    mesh = _safety_and_engine(
        tmp_path / "mesh", stories_model, gate_a, THERMOCLINE_ENGINE_GATE_FILE=str(gate_a)
    )

    async def scenario() -> None:
        with holding_service_token(mesh.service_token_path):  # the router here calls as the gateway
            router = Router(RoutingConfig(engine_targets=(mesh.target("engine"),)))
        (replica,) = router.replicas
        await router.start()
        try:
            await _wait_until(lambda: replica.is_serving and replica.is_ready, WAIT_S)
            await asyncio.to_thread(_restart_safety, mesh, gate_b)  # safety redeployed with another gate
            await _wait_until(lambda: not replica.is_ready, WAIT_S)
            assert replica.is_serving  # live: a restart would reload the same gate
            error = await _generate_error(router)
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "safety gate" in (error.details() or "")
        finally:
            await router.close()

    try:
        asyncio.run(scenario())
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def refusing_and_ready(stories_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Safety on gate "b"; "engine" holds gate "a" (it refuses every Generate: live, not ready) and
    "engine-2" holds gate "b" (ready). Only "engine" serves /metrics."""
    state_dir = tmp_path_factory.mktemp("refusing-and-ready")
    gate_a = _stories_gate(state_dir / "a.safetensors", "a")
    gate_b = _stories_gate(state_dir / "b.safetensors", "b")
    settings = {
        "THERMOCLINE_SAFETY_GATE_FILE": str(gate_b),
        "THERMOCLINE_ENGINE_KVSTORE_TARGET": "",  # no kvstore: no cold tier
    }
    config = MeshConfig(str(stories_model), state_dir, Ports.free(), env=settings, num_engines=2)
    mesh = Mesh(config)
    mesh.logs_dir.mkdir(parents=True, exist_ok=True)
    try:
        mesh.start_service("safety")
        for name, gate in (("engine", gate_a), ("engine-2", gate_b)):
            config.env["THERMOCLINE_ENGINE_GATE_FILE"] = str(gate)
            mesh.start_service(name)
        with holding_service_token(mesh.service_token_path):  # the router here calls as the gateway
            yield mesh
    finally:
        mesh.stop()


async def _started_upstreams(mesh: Mesh) -> Upstreams:
    """Upstreams over both engines, the refusing one listed first, once the router has seen the
    refusing one live and the other live and ready."""
    router = Router(RoutingConfig(engine_targets=(mesh.target("engine"), mesh.target("engine-2"))))
    refusing, ready = router.replicas
    await router.start()
    await _wait_until(lambda: refusing.is_serving and ready.is_serving and ready.is_ready, WAIT_S)
    info = await refusing.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=WAIT_S)
    assert info.safety_gate.is_refusing, info.safety_gate  # the premise: live, but refusing
    return Upstreams(router, mesh.target("safety"))


def test_model_info_comes_from_a_ready_replica_before_a_live_refusing_one(refusing_and_ready: Mesh) -> None:
    async def scenario() -> engine_pb2.GetModelInfoResponse:
        upstreams = await _started_upstreams(refusing_and_ready)
        try:
            return await upstreams.model_info(WAIT_S)
        finally:
            await upstreams.close()

    gate = asyncio.run(scenario()).safety_gate
    assert (gate.version, gate.is_refusing) == ("b", False), gate


def test_prompt_tokens_are_counted_by_a_ready_replica_before_a_live_refusing_one(
    refusing_and_ready: Mesh,
) -> None:
    async def scenario() -> int:
        upstreams = await _started_upstreams(refusing_and_ready)
        try:
            return await upstreams.count_tokens(engine_pb2.CountTokensRequest(prompt=STORIES_PROMPT), WAIT_S)
        finally:
            await upstreams.close()

    counted_by_refusing = engine_counts_served(refusing_and_ready)
    assert asyncio.run(scenario()) == len(STORIES_PROMPT_IDS)
    assert engine_counts_served(refusing_and_ready) == counted_by_refusing, "the refusing replica counted it"
