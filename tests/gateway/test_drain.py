"""SIGTERM on the gateway mid-stream: the stream finishes, new calls get UNAVAILABLE (503 on the HTTP
front), the process exits."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.audit_chain import segment_paths
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_PROMPT, start_mesh
from tests.gateway.conftest import stopped
from thermocline.gateway.v1 import gateway_pb2 as pb

GRACE_S = 60
STREAM_TOKENS = 64  # more than one screening window: the stream waits on the safety service to finish
# Sixteen 16-token windows, screened one after another: a window or two may pass before the test
# stops safety, but finishing takes every screen, so the stream waits on safety when the grace ends.
CUT_STREAM_TOKENS = 256


@pytest.fixture(scope="module")
def mesh(
    stories_model: Path, collector: TraceCollector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    started = start_mesh(
        stories_model,
        tmp_path_factory.mktemp("drain-mesh"),
        collector,
        THERMOCLINE_GATEWAY_GRACE_S=str(GRACE_S),
        THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S="300",  # the test holds the safety service stopped
    )
    yield started
    started.stop()


def wait_not_serving(channel: grpc.Channel) -> None:
    """Follows the gateway's health stream until it reports NOT_SERVING."""
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
    for reply in watch:
        if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            watch.cancel()
            return
    raise AssertionError("health stream ended without NOT_SERVING")


def http_status(request: urllib.request.Request) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of one call to the HTTP front."""
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def assert_http_front_refuses(mesh: Mesh, token: str) -> None:
    """While the gateway drains, its HTTP front is not ready and refuses new calls with 503."""
    status, body = http_status(urllib.request.Request(mesh.http_url().removesuffix("/v1") + "/ready"))
    assert status == 503 and "shutting down" in body["error"]["message"]
    completion = urllib.request.Request(
        f"{mesh.http_url()}/completions",
        data=json.dumps({"model": "", "prompt": STORIES_PROMPT, "max_tokens": 1}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    status, body = http_status(completion)
    assert status == 503 and "retry on another replica" in body["error"]["message"]


def read_until_cut(stream: Iterator[pb.GenerateResponse]) -> tuple[int, grpc.RpcError]:
    """Reads a stream until it fails: the tokens that arrived before its error, and the error."""
    num_tokens = 0
    try:
        for message in stream:
            num_tokens += len(message.delta.token_ids)
    except grpc.RpcError as error:
        return num_tokens, error
    raise AssertionError("the stream finished instead of being cut")


def test_sigterm_drains_in_flight_streams_and_refuses_new_calls(mesh: Mesh) -> None:
    token = mint_token(mesh.private_key_path.read_bytes(), subject="tester")
    metadata = call_metadata(token)
    long_request = build_request(STORIES_PROMPT, max_tokens=STREAM_TOKENS)
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stream = stream_generate(channel, long_request, metadata, timeout_s=300)
        first = next(stream)
        assert first.HasField("delta")
        # the stream's next window waits on the stopped safety service: it is in flight for sure
        with stopped(mesh.processes["safety"]):
            mesh.processes["gateway"].send_signal(signal.SIGTERM)
            wait_not_serving(channel)
            with pytest.raises(grpc.RpcError) as refused:
                collect(stream_generate(channel, build_request(STORIES_PROMPT, max_tokens=4), metadata, 10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in refused.value.details()
            assert_http_front_refuses(mesh, token)
        rest = collect(stream)
    assert rest.done is not None and rest.done.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.delta.token_ids) + len(rest.token_ids) == STREAM_TOKENS
    assert mesh.processes["gateway"].wait(GRACE_S) == 0


def test_a_stream_still_running_when_the_grace_period_ends_is_cut_reported_and_audited(mesh: Mesh) -> None:
    name = "gateway-short-grace"
    target = mesh.start_gateway_replica(name, THERMOCLINE_GATEWAY_GRACE_S="1")
    token = mint_token(mesh.private_key_path.read_bytes(), subject="tester")
    metadata = [*call_metadata(token), ("x-request-id", "cut-me")]
    with grpc.insecure_channel(target) as channel:
        stream = stream_generate(
            channel, build_request(STORIES_PROMPT, max_tokens=CUT_STREAM_TOKENS), metadata, 300
        )
        first = next(stream)
        # The stream cannot finish within the grace period. The windows safety screened before it
        # stopped still go out (a second one on a loaded machine): they count as sent.
        with stopped(mesh.processes["safety"]):
            mesh.processes[name].send_signal(signal.SIGTERM)
            num_after_first, cut = read_until_cut(stream)
    assert cut.code() == grpc.StatusCode.UNAVAILABLE
    sent = len(first.delta.token_ids) + num_after_first
    assert f"1 s grace period ran out; this stream was cut after {sent} tokens" in (cut.details() or "")
    assert mesh.processes[name].wait(60) == 0
    assert "cutting 1 stream(s): cut-me (tenant tester" in mesh.log_tail(name, 200)
    events = [
        json.loads(line)
        for path in segment_paths(mesh.config.state_dir / f"audit-{name}", "decisions")
        for line in path.read_text().splitlines()
    ]
    assert [(e["action"], e["decision"]) for e in events if e["request_id"] == "cut-me"] == [
        ("invoke", "allow"),
        ("stream.cut", "deny"),
    ]
