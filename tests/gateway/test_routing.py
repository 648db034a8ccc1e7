"""Routing across two real engine replicas: prefix affinity, then failover when one drains."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.mesh import Mesh, MeshConfig, Ports
from services.cli.trace_collector import TraceCollector
from tests.gateway.conftest import call, token
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc

MAX_TOKENS = 3


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    state_dir = tmp_path_factory.mktemp("routing-mesh")
    tenants = state_dir / "tenants.json"
    tenants.write_text(json.dumps({"defaults": {"requests_per_s": 10_000, "burst_requests": 10_000}}))
    config = MeshConfig(
        model=str(stories_model),
        state_dir=state_dir,
        ports=Ports.free(),
        otlp_endpoint=collector.endpoint,
        startup_timeout_s=300,
        num_engines=2,
        env={
            "THERMOCLINE_GATEWAY_ENGINE_STATS_INTERVAL_S": "0.2",
            "THERMOCLINE_GATEWAY_TENANTS_FILE": str(tenants),
        },
    )
    started = Mesh(config).__enter__()
    yield started
    started.stop()


def generated_tokens(mesh: Mesh) -> dict[str, int]:
    """Tokens each live engine replica has generated since it started."""
    counts = {}
    for name in mesh.engine_names:
        if mesh.processes[name].poll() is not None:
            continue
        with mesh.channel(name) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            stats = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)
        counts[name] = int(stats.generated_tokens_total)
    return counts


def test_a_repeated_prefix_returns_to_the_same_replica(mesh: Mesh) -> None:
    bearer = token(mesh)
    before = generated_tokens(mesh)
    for _ in range(6):
        call(mesh.target("gateway"), bearer, max_tokens=MAX_TOKENS, prompt="Lily went to the park")
    after = generated_tokens(mesh)
    grown = {name: after[name] - before[name] for name in after}
    assert sorted(grown.values()) == [0, 6 * MAX_TOKENS], grown


def test_stopping_the_replica_moves_traffic_and_no_request_fails(mesh: Mesh) -> None:
    bearer = token(mesh)
    prompt = "Ben had a red ball"
    before = generated_tokens(mesh)
    call(mesh.target("gateway"), bearer, max_tokens=MAX_TOKENS, prompt=prompt)
    grown = {name: count - before[name] for name, count in generated_tokens(mesh).items()}
    home = max(grown, key=lambda name: grown[name])
    other = next(name for name in mesh.engine_names if name != home)

    failures: list[str] = []
    stopped = threading.Event()

    def keep_calling() -> None:
        """Calls until the home replica is gone, then two calls more."""
        num_after_stop = 0
        while num_after_stop < 2:
            is_after_stop = stopped.is_set()
            try:
                call(mesh.target("gateway"), bearer, max_tokens=MAX_TOKENS, prompt=prompt)
            except grpc.RpcError as error:
                failures.append(f"{error.code().name}: {error.details()}")
            num_after_stop += int(is_after_stop)

    callers = [threading.Thread(target=keep_calling) for _ in range(3)]
    for caller in callers:
        caller.start()
    mesh.processes[home].send_signal(signal.SIGTERM)  # drains: health NOT_SERVING, new calls refused
    assert mesh.processes[home].wait(60) == 0
    other_before = generated_tokens(mesh)[other]
    stopped.set()
    for caller in callers:
        caller.join(120)
    assert failures == []
    assert generated_tokens(mesh)[other] >= other_before + 6 * MAX_TOKENS
