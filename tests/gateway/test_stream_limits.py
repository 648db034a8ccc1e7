"""A stream whose caller set no deadline still ends: at THERMOCLINE_GATEWAY_MAX_STREAM_S the gateway
ends it with DEADLINE_EXCEEDED and frees its slot. (A caller that stops reading is cut the same way after
THERMOCLINE_GATEWAY_WRITE_STALL_S; grpc's client reads ahead of the application, so a test client
cannot hold a write back, and that path was measured by hand: docs/gateway_security.md.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.gateway.conftest import gauge_value, stopped, token

MAX_STREAM_S = 2


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    started = start_mesh(
        stories_model,
        tmp_path_factory.mktemp("stream-limits-mesh"),
        collector,
        THERMOCLINE_GATEWAY_MAX_STREAM_S=str(MAX_STREAM_S),
        THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S="300",  # the test holds the safety service stopped
    )
    yield started
    started.stop()


def test_a_stream_without_a_deadline_is_cancelled_at_the_gateways_limit_and_frees_its_slot(
    mesh: Mesh,
) -> None:
    metadata = call_metadata(token(mesh))
    request = build_request(STORIES_PROMPT, max_tokens=4)
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        collect(stream_generate(channel, request, metadata, 60))  # the channel to safety is up
        # With safety stopped, the call waits on its prompt's screen for longer than the limit.
        with stopped(mesh.processes["safety"]), pytest.raises(grpc.RpcError) as caught:
            collect(stream_generate(channel, request, metadata, timeout_s=None))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "THERMOCLINE_GATEWAY_MAX_STREAM_S" in (caught.value.details() or "")
    in_flight = "thermocline_gateway_in_flight_requests"
    deadline = time.monotonic() + 30
    while gauge_value(mesh.config.ports.metrics["gateway"], in_flight) != 0:
        assert time.monotonic() < deadline, "the cancelled stream still holds its slot"
