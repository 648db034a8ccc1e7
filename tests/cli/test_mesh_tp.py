"""The engine service started with THERMOCLINE_ENGINE_TP=2 launches its own second rank, serves the
golden stories260K continuation through the real mesh, and turns NOT_SERVING when that rank dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_GOLDEN_IDS, STORIES_PROMPT, start_mesh


def test_an_engine_set_to_tp2_serves_the_golden_continuation_and_reports_a_lost_rank(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> None:
    state_dir = tmp_path_factory.mktemp("tp2-mesh")
    mesh = start_mesh(stories_model, state_dir, collector, THERMOCLINE_ENGINE_TP="2")
    try:
        token = mint_token(mesh.private_key_path.read_bytes(), subject="tester", tenant="acme")
        with grpc.insecure_channel(mesh.target("gateway")) as channel:
            result = _generate(channel, token)
            assert result.token_ids == STORIES_GOLDEN_IDS
            assert "tp=2" in mesh.log_tail("engine", num_lines=200)
            os.kill(_rank1_pid(mesh.processes["engine"].pid), signal.SIGKILL)
            _wait_not_serving(mesh)
            with pytest.raises(grpc.RpcError) as refused:
                _generate(channel, token)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "tensor-parallel rank 1 exited" in mesh.log_tail("engine", num_lines=200)
    finally:
        mesh.stop()


def _generate(channel: grpc.Channel, token: str):  # type: ignore[no-untyped-def]
    request = build_request(STORIES_PROMPT, max_tokens=40)
    return collect(stream_generate(channel, request, call_metadata(token), timeout_s=120))


def _rank1_pid(engine_pid: int) -> int:
    """The engine's child process that runs rank 1 (the other child is multiprocessing's tracker)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == engine_pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"engine process {engine_pid} has no rank-1 child")


def _wait_not_serving(mesh: Mesh) -> None:
    """Follow the engine's health Watch until it reports NOT_SERVING (or the deadline passes)."""
    with mesh.channel("engine") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60
        )
        for reply in watch:
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                watch.cancel()
                return
