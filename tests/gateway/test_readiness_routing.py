"""The router against a real engine whose safety gate comes to differ from the safety service's:
live but not ready, and still routed to while no replica is ready, so the caller gets the engine's
FAILED_PRECONDITION that names the gate instead of UNAVAILABLE."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from services.gateway.config import RoutingConfig
from services.gateway.router import Router
from tests.engine.gate.test_gate_watch import _restart_safety, _safety_and_engine, _stories_gate
from tests.gateway.test_router import _wait_until
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
