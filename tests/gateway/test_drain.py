"""SIGTERM on the gateway mid-stream: the stream finishes, new calls get UNAVAILABLE (503 on the HTTP
front), the process exits; a stream still running when the grace period ends is cut, reported and
audited, wherever its task waits (on safety, or on a client that stopped reading), on either front."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh
from services.cli.trace_collector import TraceCollector
from services.gateway.audit_chain import segment_paths
from services.gateway.tokens import mint_token
from tests.conftest import STORIES_PROMPT, rpcs_handled, start_mesh
from tests.gateway.conftest import client_request_id, stopped
from thermocline.gateway.v1 import gateway_pb2 as pb

GRACE_S = 60
STREAM_TOKENS = 64  # more than one screening window: the stream waits on the safety service to finish
# Sixteen 16-token windows, screened one after another: a window or two may pass before the test
# stops safety, but finishing takes every screen, so the stream waits on safety when the grace ends.
CUT_STREAM_TOKENS = 256
# A client that stops reading: no window beyond 1 byte (and no BDP probing to grow it) unless a read
# waits, so once it stops, the gateway's next message waits in its write.
SLOW_READER = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1)]
CHECK_OUTPUT = "/thermocline.safety.v1.SafetyService/CheckOutput"


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


def output_screens(mesh: Mesh) -> float:
    """How many output screens the safety service has answered, from its /metrics."""
    return rpcs_handled(f"http://127.0.0.1:{mesh.config.ports.metrics['safety']}/metrics", CHECK_OUTPUT)


def wait_for_output_screens(mesh: Mesh, num_screens: float, timeout_s: float = 60) -> None:
    """Waits until the safety service has answered `num_screens` output screens."""
    deadline = time.monotonic() + timeout_s
    while output_screens(mesh) < num_screens:
        assert time.monotonic() < deadline, f"safety answered fewer than {num_screens} output screens"


def request_events(mesh: Mesh, gateway: str, request_id: str) -> list[dict[str, Any]]:
    """A request's events in a gateway replica's decisions log, oldest first."""
    events = [
        json.loads(line)
        for path in segment_paths(mesh.config.state_dir / f"audit-{gateway}", "decisions")
        for line in path.read_text().splitlines()
    ]
    return [event for event in events if client_request_id(event) == request_id]


def audit_events(mesh: Mesh, gateway: str, request_id: str) -> list[tuple[str, str]]:
    """(action, decision) of each of a request's events in a gateway replica's decisions log."""
    return [(e["action"], e["decision"]) for e in request_events(mesh, gateway, request_id)]


def wait_for_cut_record(mesh: Mesh, gateway: str, request_id: str, timeout_s: float = 60) -> None:
    """Waits until the gateway has audited the request's cut, or has exited (then it never will)."""
    process = mesh.processes[gateway]
    deadline = time.monotonic() + timeout_s
    while ("stream.cut", "deny") not in audit_events(mesh, gateway, request_id):
        assert time.monotonic() < deadline, f"no stream.cut for {request_id} after {timeout_s} s"
        try:
            process.wait(0.05)  # waits on the process's exit: the poll's pace, not a fixed delay
            return
        except subprocess.TimeoutExpired:
            pass


def post_stream(url: str, token: str, body: dict[str, Any], request_id: str) -> http.client.HTTPResponse:
    """Opens an SSE stream on the HTTP front at `url` (…/v1/completions)."""
    address = urlsplit(url)
    assert address.hostname is not None
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/json",
        "X-Request-Id": request_id,
    }
    connection.request("POST", address.path, json.dumps(body | {"stream": True}), headers)
    return connection.getresponse()


def sse_data(answer: http.client.HTTPResponse) -> Iterator[Any]:
    """The data of each server-sent event, parsed ("[DONE]" as is), until the server ends the answer
    or breaks it off."""
    try:
        while line := answer.readline():
            if line.startswith(b"data: "):
                data = line.removeprefix(b"data: ").strip()
                yield data.decode() if data == b"[DONE]" else json.loads(data)
    except (http.client.HTTPException, OSError):
        return


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
    own_id = request_events(mesh, name, "cut-me")[0]["request_id"]
    assert f"cutting 1 stream(s): {own_id} (client request id cut-me, tenant tester" in mesh.log_tail(
        name, 200
    )
    assert audit_events(mesh, name, "cut-me") == [("invoke", "allow"), ("stream.cut", "deny")]


def test_streams_cut_while_their_writes_wait_on_clients_that_stopped_reading_are_reported_and_audited(
    mesh: Mesh,
) -> None:
    """Two clients stop reading after the first message: the gateway's second waits in its write when
    the grace period ends. One reads again after the cut and gets that message, then the cut's
    status; the other never reads again, and holds the drain only until the server stops."""
    name = "gateway-slow-readers"
    target = mesh.start_gateway_replica(name, THERMOCLINE_GATEWAY_GRACE_S="1")
    token = mint_token(mesh.private_key_path.read_bytes(), subject="tester")
    request = build_request(STORIES_PROMPT, max_tokens=CUT_STREAM_TOKENS)
    num_screens = output_screens(mesh)
    with (
        grpc.insecure_channel(target, options=SLOW_READER) as slow_channel,
        grpc.insecure_channel(target, options=SLOW_READER) as gone_channel,
    ):
        slow = stream_generate(slow_channel, request, [*call_metadata(token), ("x-request-id", "slow")], 300)
        gone = stream_generate(gone_channel, request, [*call_metadata(token), ("x-request-id", "gone")], 300)
        first = next(slow)
        next(gone)
        # Each stream's second window is screened: the gateway holds its message, which waits in
        # its write for a client that reads no more, through the whole grace period.
        wait_for_output_screens(mesh, num_screens + 4)
        mesh.processes[name].send_signal(signal.SIGTERM)
        wait_for_cut_record(mesh, name, "slow")
        num_after_first, cut = read_until_cut(slow)  # the client reads again
        # The one that never reads again holds the drain only until the server stops (CUT_WAIT_S).
        assert mesh.processes[name].wait(60) == 0
    assert cut.code() == grpc.StatusCode.UNAVAILABLE, cut.details()
    sent = len(first.delta.token_ids) + num_after_first
    assert f"1 s grace period ran out; this stream was cut after {sent} tokens" in (cut.details() or "")
    assert num_after_first > 0  # the message whose write the cut interrupted came ahead of the status
    for request_id in ("slow", "gone"):
        assert audit_events(mesh, name, request_id) == [("invoke", "allow"), ("stream.cut", "deny")]


def test_an_http_stream_still_running_when_the_grace_period_ends_is_cut_reported_and_audited(
    mesh: Mesh,
) -> None:
    """No gRPC call is in flight: the drain waits for the HTTP front's calls all the same, cuts the
    stream when the grace period ends, and waits for its answer to end. The SSE stream ends with an
    error event (no finish reason, no [DONE]) that counts the tokens sent, as its stream.cut does."""
    name = "gateway-http-cut"
    mesh.start_gateway_replica(name, THERMOCLINE_GATEWAY_GRACE_S="1")
    token = mint_token(mesh.private_key_path.read_bytes(), subject="tester")
    body = {"model": "", "prompt": STORIES_PROMPT, "max_tokens": CUT_STREAM_TOKENS}
    answer = post_stream(f"{mesh.http_url(name)}/completions", token, body, "http-cut")
    assert answer.status == 200, answer.read()
    events = sse_data(answer)
    first = next(events)
    # The stream cannot finish within the grace period: its next window waits on safety.
    with stopped(mesh.processes["safety"]):
        mesh.processes[name].send_signal(signal.SIGTERM)
        *chunks, last = [first, *events]
    assert mesh.processes[name].wait(60) == 0
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None] * len(chunks)
    assert "error" in last, f"the stream ended without an error event: {last}"
    cut = last["error"]
    assert (cut["type"], cut["code"]) == ("server_error", "unavailable")
    assert "1 s grace period ran out" in cut["message"]
    own_id = request_events(mesh, name, "http-cut")[0]["request_id"]
    assert f"cutting 1 stream(s): {own_id} (client request id http-cut, tenant tester" in mesh.log_tail(
        name, 200
    )
    assert audit_events(mesh, name, "http-cut") == [("invoke", "allow"), ("stream.cut", "deny")]
    num_sent = request_events(mesh, name, "http-cut")[-1]["details"]["tokens_sent"]
    assert f"this stream was cut after {num_sent} tokens" in cut["message"]
