"""A hung safety service, as the caller sees it: UNAVAILABLE once the gateway's own safety timeout
runs out (a status clients retry), DEADLINE_EXCEEDED only when the caller's shorter deadline does."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.audit_chain import segment_paths
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.gateway.conftest import client_request_id, stopped, token

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


def _audited(mesh: Mesh, request_id: str) -> list[dict[str, object]]:
    return [
        event
        for path in segment_paths(mesh.audit_dir, "decisions")
        for line in path.read_text().splitlines()
        if client_request_id(event := json.loads(line)) == request_id
    ]


def test_a_stream_that_fails_mid_answer_says_how_much_was_sent_and_is_audited(mesh: Mesh) -> None:
    _served(mesh)
    metadata = [*call_metadata(token(mesh)), ("x-request-id", "fails-mid-answer")]
    request = build_request(STORIES_PROMPT, max_tokens=200)  # many output windows
    received, is_stopped = 0, False
    try:
        with grpc.insecure_channel(mesh.target("gateway")) as channel:
            stream = stream_generate(channel, request, metadata, 60)
            with pytest.raises(grpc.RpcError) as caught:
                for message in stream:
                    received += len(message.delta.token_ids)
                    if received and not is_stopped:
                        mesh.processes["safety"].send_signal(signal.SIGSTOP)  # the next window hangs
                        is_stopped = True
    finally:
        mesh.processes["safety"].send_signal(signal.SIGCONT)  # the module's mesh goes on
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"{received} tokens of the answer had been sent" in (caught.value.details() or "")
    (allow, failed) = _audited(mesh, "fails-mid-answer")
    assert allow["decision"] == "allow" and failed["action"] == "stream.failed"
    assert failed["details"] == {"client_request_id": "fails-mid-answer", "tokens_sent": received}
    assert "safety did not answer" in str(failed["reason"])
