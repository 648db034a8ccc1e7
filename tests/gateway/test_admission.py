"""Load shedding and token budgets through a real gateway capped at two concurrent streams."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.gateway.conftest import gauge_value, refusal, stopped, token
from thermocline.engine.v1 import engine_pb2, engine_pb2_grpc
from thermocline.gateway.v1 import gateway_pb2 as pb

MAX_STREAMS = 2
LONG_TOKENS = 1500  # about 2 s of decoding on a laptop core
STREAM_TOKENS = 64  # more than one screening window
DEFAULT_MAX_TOKENS = 7  # the gateway's completion length for a request that gives none
SOLO_TENANT = "solo"  # one stream in flight at a time
FRUGAL_TENANT = "frugal"  # 1000 tokens a request, below the engine's max_tokens limit of 4096


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("admission-mesh")
    tenants_file = state / "tenants.json"
    tenants = {SOLO_TENANT: {"max_streams": 1}, FRUGAL_TENANT: {"max_request_tokens": 1000}}
    tenants_file.write_text(json.dumps({"tenants": tenants}))
    started = start_mesh(
        stories_model,
        state,
        collector,
        THERMOCLINE_GATEWAY_TENANTS_FILE=str(tenants_file),
        THERMOCLINE_GATEWAY_MAX_CONCURRENT_STREAMS=str(MAX_STREAMS),
        THERMOCLINE_GATEWAY_PUSHBACK_MS="750",
        THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S="300",  # the tests below hold the safety service stopped
        THERMOCLINE_GATEWAY_DEFAULT_MAX_TOKENS=str(DEFAULT_MAX_TOKENS),
    )
    yield started
    started.stop()


def _streams_in_flight(mesh: Mesh) -> float:
    return gauge_value(mesh.config.ports.metrics["gateway"], "thermocline_gateway_in_flight_requests")


def _wait_for_streams_in_flight(mesh: Mesh, count: int, timeout_s: float = 60.0) -> None:
    """Polls the gateway's gauge until `count` streams hold admission slots."""
    deadline = time.monotonic() + timeout_s
    while (now := _streams_in_flight(mesh)) != count:
        assert time.monotonic() < deadline, f"{now:.0f} streams in flight, expected {count}"


def test_streams_beyond_the_cap_are_shed_while_admitted_ones_complete(mesh: Mesh) -> None:
    metadata = call_metadata(token(mesh))
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        # The gateway's channel to safety connects first: a connection opened while safety is
        # stopped gets no HTTP/2 settings, and gRPC gives up on it after its connect timeout.
        collect(stream_generate(channel, build_request(STORIES_PROMPT, max_tokens=1), metadata, 60))
        # With the safety service stopped, an admitted stream cannot finish (its prompt or its first
        # window waits on screening), so both slots stay taken however fast or slow the machine is.
        with stopped(mesh.processes["safety"]):
            streams = [
                stream_generate(
                    channel, build_request(STORIES_PROMPT, max_tokens=STREAM_TOKENS), metadata, 300
                )
                for _ in range(MAX_STREAMS)
            ]
            _wait_for_streams_in_flight(mesh, MAX_STREAMS)
            with pytest.raises(grpc.RpcError) as shed:
                collect(stream_generate(channel, build_request(STORIES_PROMPT, max_tokens=4), metadata, 30))
        results = [collect(stream) for stream in streams]
    assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"limit of {MAX_STREAMS} concurrent streams" in shed.value.details()
    assert dict(shed.value.trailing_metadata() or ())["grpc-retry-pushback-ms"] == "750"
    for result in results:
        assert result.done is not None and result.done.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(result.token_ids) == STREAM_TOKENS
    _wait_for_streams_in_flight(mesh, 0)  # the slots are free again
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        again = collect(stream_generate(channel, build_request(STORIES_PROMPT, max_tokens=4), metadata, 30))
    assert again.done is not None


def test_a_tenant_at_its_own_stream_cap_is_refused_before_its_screen_and_others_are_not(
    mesh: Mesh,
) -> None:
    solo = call_metadata(token(mesh, subject="solo-user", tenant=SOLO_TENANT))
    request = build_request(STORIES_PROMPT, max_tokens=4)
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        # With the safety service stopped, the admitted stream waits on its prompt's screen and
        # holds the tenant's one slot, however fast the machine is.
        with stopped(mesh.processes["safety"]):
            held = stream_generate(channel, request, solo, 300)
            _wait_for_streams_in_flight(mesh, 1)
            with pytest.raises(grpc.RpcError) as refused:
                collect(stream_generate(channel, request, solo, 30))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant 'solo' has 1 streams in flight on this gateway" in (refused.value.details() or "")
            other = stream_generate(channel, request, call_metadata(token(mesh)), 300)  # another tenant
            _wait_for_streams_in_flight(mesh, 2)  # admitted beside it, waiting on its screen too
        assert collect(held).done is not None and collect(other).done is not None
        # The slot came back with the stream's end.
        assert collect(stream_generate(channel, request, solo, 60)).done is not None


def test_a_request_over_its_token_budget_gets_both_counts(mesh: Mesh) -> None:
    error = refusal(mesh.target("gateway"), token(mesh, tenant=FRUGAL_TENANT), max_tokens=2000)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5 prompt tokens" in error.details() and "2000 max_tokens = 2005" in error.details()
    assert "allows 1000 per request" in error.details()


def test_a_request_without_max_tokens_gets_the_gateway_default(mesh: Mesh) -> None:
    metadata = call_metadata(token(mesh))
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        result = collect(stream_generate(channel, build_request(STORIES_PROMPT), metadata, 60))
    assert result.done is not None
    assert result.done.finish_reason == pb.FINISH_REASON_LENGTH
    assert result.done.usage.completion_tokens == DEFAULT_MAX_TOKENS


def test_an_expired_deadline_frees_the_engine(mesh: Mesh) -> None:
    metadata = call_metadata(token(mesh))
    long_request = build_request(STORIES_PROMPT, max_tokens=LONG_TOKENS)
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stream = stream_generate(channel, long_request, metadata, timeout_s=1.0)
        with pytest.raises(grpc.RpcError) as caught:
            collect(stream)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with mesh.channel("engine") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        deadline = time.monotonic() + 30
        while (stats := stub.GetStats(engine_pb2.GetStatsRequest())).num_running + stats.num_waiting:
            assert time.monotonic() < deadline, f"engine still holds the expired request: {stats}"
