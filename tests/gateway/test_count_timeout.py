"""An engine that does not count a prompt, as the caller sees it: UNAVAILABLE with a message once the
gateway's own bound on the count runs out (COUNT_TIMEOUT_S), DEADLINE_EXCEEDED only when the
caller's shorter deadline does. The engine is held stopped (SIGSTOP), whatever the machine's speed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.budget import COUNT_TIMEOUT_S
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.gateway.conftest import stopped, token


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    started = start_mesh(stories_model, tmp_path_factory.mktemp("count-timeout-mesh"), collector)
    yield started
    started.stop()


def _call(mesh: Mesh, deadline_s: float) -> None:
    prompt = f"{STORIES_PROMPT} {uuid.uuid4().hex}"  # never counted before: the count cache misses
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        collect(
            stream_generate(
                channel, build_request(prompt, max_tokens=2), call_metadata(token(mesh)), deadline_s
            )
        )


def _error(mesh: Mesh, deadline_s: float) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        _call(mesh, deadline_s)
    return caught.value


def test_an_engine_that_does_not_count_is_unavailable_and_a_short_deadline_is_the_callers(mesh: Mesh) -> None:
    _call(mesh, 60)  # the gateway's channel to the engine is up: the hang is in the count
    with stopped(mesh.processes["engine"]):
        hung = _error(mesh, deadline_s=120)
        assert hung.code() == grpc.StatusCode.UNAVAILABLE, hung.details()
        assert (
            f"the engine did not count the prompt within {COUNT_TIMEOUT_S:g} s; retry later" in hung.details()
        )
        short = _error(mesh, deadline_s=1)
        assert short.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _call(mesh, 60)  # the engine is back: served again
