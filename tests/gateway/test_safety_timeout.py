"""A hung safety service, as the caller sees it: UNAVAILABLE once the gateway's own safety timeout
runs out (a status clients retry), DEADLINE_EXCEEDED only when the caller's shorter deadline does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.gateway.conftest import stopped, token

SAFETY_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    started = start_mesh(
        stories_model,
        tmp_path_factory.mktemp("safety-timeout-mesh"),
        collector,
        THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S=str(SAFETY_TIMEOUT_S),
    )
    yield started
    started.stop()


def _error(mesh: Mesh, deadline_s: float) -> grpc.RpcError:
    metadata = call_metadata(token(mesh))
    request = build_request(STORIES_PROMPT, max_tokens=4)
    with grpc.insecure_channel(mesh.target("gateway")) as channel, pytest.raises(grpc.RpcError) as caught:
        collect(stream_generate(channel, request, metadata, deadline_s))
    return caught.value


def test_a_hung_safety_service_is_unavailable_and_a_short_caller_deadline_is_the_callers(mesh: Mesh) -> None:
    _served(mesh)  # the gateway's channel to safety is up: the hang is in the check, not the connect
    with stopped(mesh.processes["safety"]):
        hung = _error(mesh, deadline_s=60)
        assert hung.code() == grpc.StatusCode.UNAVAILABLE
        assert f"safety did not answer within {SAFETY_TIMEOUT_S} s" in (hung.details() or "")
        assert "retry later" in (hung.details() or "")
        short = _error(mesh, deadline_s=1)
        assert short.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _served(mesh)  # safety is back: served again


def _served(mesh: Mesh) -> None:
    metadata = call_metadata(token(mesh))
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        result = collect(stream_generate(channel, build_request(STORIES_PROMPT, max_tokens=4), metadata, 60))
    assert result.done is not None
