"""The gateway's cap on concurrent streams against the HTTP front of a real gateway capped at one:
a call that finds it full is refused at its head, its body unread, with the refusal the cap gives
a call whose body was read (and a gRPC call)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import grpc
import pytest

from services.cli.client import build_request, call_metadata, collect, stream_generate
from services.cli.mesh import Mesh, free_port
from tests.conftest import STORIES_PROMPT
from tests.gateway.conftest import gauge_value, stopped
from tests.http.conftest import Exchange, HttpGateway, http_replica

PUSHBACK_MS = 750
FULL = "gateway is at its limit of 1 concurrent streams; retry after 750 ms or on another replica"
COMPLETION = json.dumps({"prompt": STORIES_PROMPT, "max_tokens": 2, "temperature": 0.0}).encode()


@pytest.fixture(scope="module")
def capped_gateway(open_mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpGateway]:
    """A gateway that serves one stream at a time, its /metrics served."""
    settings = {
        "THERMOCLINE_GATEWAY_MAX_CONCURRENT_STREAMS": "1",
        "THERMOCLINE_GATEWAY_PUSHBACK_MS": str(PUSHBACK_MS),
        "THERMOCLINE_GATEWAY_SAFETY_TIMEOUT_S": "300",  # the held stream waits on a stopped safety service
        "THERMOCLINE_GATEWAY_METRICS_PORT": str(free_port()),
    }
    with http_replica(open_mesh, tmp_path_factory, "gateway-http-capped", **settings) as gateway:
        yield gateway


@contextlib.contextmanager
def held_slot(gateway: HttpGateway) -> Iterator[None]:
    """The gateway's one stream slot, held by a gRPC stream that waits on the stopped safety
    service, however fast the machine is; the stream is read to its end on exit."""
    metadata = call_metadata(gateway.user_token, "chat")
    with grpc.insecure_channel(gateway.mesh.target(gateway.name)) as channel:
        # the gateway's channel to safety connects first: one opened while safety is stopped fails
        collect(stream_generate(channel, build_request(STORIES_PROMPT, max_tokens=1), metadata, 60))
        with stopped(gateway.mesh.processes["safety"]):
            held = stream_generate(channel, build_request(STORIES_PROMPT, max_tokens=2), metadata, 300)
            _wait_for_streams_in_flight(gateway, 1)
            yield
        assert collect(held).done is not None


def _wait_for_streams_in_flight(gateway: HttpGateway, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (now := gauge_value(gateway.metrics_port, "thermocline_gateway_in_flight_requests")) != count:
        assert time.monotonic() < deadline, f"{now:.0f} streams in flight, expected {count}"


def _head(gateway: HttpGateway, content_length: int) -> bytes:
    lines = [
        "POST /v1/completions HTTP/1.1",
        "Host: x",
        f"Authorization: Bearer {gateway.user_token}",
        "X-Intent: chat",
        f"Content-Length: {content_length}",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _refusal(exchange: Exchange) -> tuple[dict[str, str], dict[str, object]]:
    """The headers and the error object of the one answer in `exchange`."""
    head, _, body = exchange.received.partition(b"\r\n\r\n")
    fields = [line.split(b":", 1) for line in head.split(b"\r\n")[1:]]
    headers = {name.decode().lower(): value.decode().strip() for name, value in fields}
    return headers, json.loads(body)["error"]


def test_a_full_gateway_refuses_a_call_at_its_head_without_reading_the_body(
    capped_gateway: HttpGateway,
) -> None:
    with held_slot(capped_gateway):
        # a body that never comes: only a refusal made from the head can answer it
        exchange = capped_gateway.exchange(_head(capped_gateway, 100_000) + b'{"prompt": "')
    assert exchange.status_lines == ["HTTP/1.1 429 Too Many Requests"], exchange.received
    headers, error = _refusal(exchange)
    assert error["message"] == FULL and error["code"] == "resource_exhausted"
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("1", str(PUSHBACK_MS))
    assert headers["connection"] == "close" and exchange.is_closed


def test_the_refusal_at_the_head_is_the_grpc_callers_and_room_again_serves(
    capped_gateway: HttpGateway,
) -> None:
    with held_slot(capped_gateway):
        with grpc.insecure_channel(capped_gateway.mesh.target(capped_gateway.name)) as channel:
            metadata = call_metadata(capped_gateway.user_token, "chat")
            with pytest.raises(grpc.RpcError) as shed:
                collect(stream_generate(channel, build_request(STORIES_PROMPT, max_tokens=2), metadata, 30))
        answer = capped_gateway.post("/completions", COMPLETION)
    assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and shed.value.details() == FULL
    assert answer.status == 429 and answer.error["message"] == FULL
    _wait_for_streams_in_flight(capped_gateway, 0)
    assert capped_gateway.post("/completions", COMPLETION).status == 200
