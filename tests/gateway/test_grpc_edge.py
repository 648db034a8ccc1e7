"""The gRPC edge: a refusal reaches the caller as its status, and the trace records no exception for it;
a caller that stops reading and then goes away ends its stream CANCELLED, without an error log.

The server here has the interceptor every service runs (the guard, which opens the call's span), with
an in-memory span exporter, and the edge in front of a servicer stand-in that refuses or stalls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes.rpc_attributes import RPC_GRPC_STATUS_CODE
from opentelemetry.trace import StatusCode
from prometheus_client import REGISTRY

from services.common.errors import PermissionDenied, ResourceExhausted
from services.common.interceptors import CallTracker, GuardInterceptor
from services.gateway.grpc_edge import add_to_server
from services.gateway.rate_limiter import PUSHBACK_KEY, retry_metadata
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc


class RefusingServicer:
    """Refuses Generate as the slot cap does, after one message when asked; ListModels as RBAC does."""

    def __init__(self, num_messages: int = 0) -> None:
        self.num_messages = num_messages

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        for _ in range(self.num_messages):
            yield pb.GenerateResponse(delta=pb.TextDelta(text="once"))
        raise ResourceExhausted(
            "gateway is at its limit; retry after 1000 ms", trailing_metadata=retry_metadata(1000)
        )

    async def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        raise PermissionDenied("permission 'list_models' is missing")


class StallingServicer:
    """Sends one token, then a message larger than the client's HTTP/2 window: a client that stops
    reading leaves that write waiting. `is_stalling` is set as the second message goes out."""

    NUM_BIG_BYTES = 4 << 20  # the window stays at 64 KiB without BDP probing, on either side

    def __init__(self) -> None:
        self.is_stalling = asyncio.Event()
        self.num_closed = 0

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        try:
            yield pb.GenerateResponse(delta=pb.TextDelta(text="once"))
            self.is_stalling.set()
            yield pb.GenerateResponse(delta=pb.TextDelta(text="x" * self.NUM_BIG_BYTES))
        finally:
            self.num_closed += 1


NO_BDP_PROBE = [("grpc.http2.bdp_probe", 0)]  # as the gateway serves (services/gateway/__main__.py)


async def _start_server(
    servicer: object, tracker: CallTracker, exporter: InMemorySpanExporter
) -> tuple[grpc.aio.Server, int]:
    """A server built as the services build theirs: the guard interceptor, then the edge."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = grpc.aio.server(
        interceptors=[GuardInterceptor(tracker, tracer_provider=provider)], options=NO_BDP_PROBE
    )
    add_to_server(servicer, server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _call_through_edge(servicer: RefusingServicer) -> tuple[list[Any], list[ReadableSpan]]:
    """Generate and ListModels through a server built as the services build theirs; outcomes and spans."""
    exporter = InMemorySpanExporter()
    server, port = await _start_server(servicer, CallTracker(), exporter)
    outcomes: list[Any] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        received: list[pb.GenerateResponse] = []
        try:
            async for message in stub.Generate(pb.GenerateRequest(prompt="hi")):
                received.append(message)
        except grpc.aio.AioRpcError as error:
            outcomes.append((received, error))
        try:
            await stub.ListModels(pb.ListModelsRequest())
        except grpc.aio.AioRpcError as error:
            outcomes.append(([], error))
    await server.stop(None)
    return outcomes, list(exporter.get_finished_spans())


def test_a_refusal_is_the_calls_status_with_its_pushback_and_no_exception_in_the_trace() -> None:
    outcomes, spans = asyncio.run(_call_through_edge(RefusingServicer()))
    (received, shed), (_, denied) = outcomes
    assert received == [] and shed.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry after 1000 ms" in shed.details()
    assert dict(shed.trailing_metadata() or ())[PUSHBACK_KEY] == "1000"
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED and "list_models" in denied.details()
    assert sorted(span.name.rsplit("/", 1)[-1] for span in spans) == ["Generate", "ListModels"]
    codes = {span.name.rsplit("/", 1)[-1]: span.attributes[RPC_GRPC_STATUS_CODE] for span in spans}
    assert codes == {"Generate": shed.code().value[0], "ListModels": denied.code().value[0]}
    assert [(span.name, event.name) for span in spans for event in span.events] == []


def test_a_refusal_after_the_stream_started_keeps_what_was_sent() -> None:
    outcomes, spans = asyncio.run(_call_through_edge(RefusingServicer(num_messages=1)))
    received, shed = outcomes[0]
    assert [m.delta.text for m in received] == ["once"]
    assert shed.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    generate = next(span for span in spans if span.name.endswith("/Generate"))
    assert generate.attributes[RPC_GRPC_STATUS_CODE] == shed.code().value[0] and not generate.events


async def _walk_away(num_calls: int) -> tuple[StallingServicer, list[ReadableSpan]]:
    """Streams whose client reads one message, stops reading, and closes its channel while the
    gateway's next write waits for window; returns once the server has finished every call."""
    servicer, tracker, exporter = StallingServicer(), CallTracker(), InMemorySpanExporter()
    server, port = await _start_server(servicer, tracker, exporter)
    for _ in range(num_calls):
        servicer.is_stalling.clear()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=NO_BDP_PROBE)
        call = pb_grpc.GatewayServiceStub(channel).Generate(pb.GenerateRequest(prompt="hi"))
        assert (await call.read()).delta.text == "once"
        await servicer.is_stalling.wait()
        await channel.close()
    assert await tracker.wait_idle(30), f"{tracker.num_in_flight} stream(s) never ended"
    await server.stop(None)
    return servicer, list(exporter.get_finished_spans())


def _num_cancelled() -> float:
    labels = {"method": "/thermocline.gateway.v1.GatewayService/Generate", "code": "CANCELLED"}
    return REGISTRY.get_sample_value("thermocline_rpc_server_handled_total", labels) or 0.0


def test_a_client_that_goes_away_at_a_stalled_write_is_a_quiet_counted_cancellation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = _num_cancelled()
    with caplog.at_level(logging.WARNING):
        servicer, spans = asyncio.run(_walk_away(5))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, caplog.text  # was: "ExecuteBatchError raised in core by servicer method", each
    assert _num_cancelled() - before == 5
    assert servicer.num_closed == 5  # each handler's cleanup ran
    codes = [span.attributes[RPC_GRPC_STATUS_CODE] for span in spans]
    assert codes == [grpc.StatusCode.CANCELLED.value[0]] * 5
    assert {span.status.status_code for span in spans} == {StatusCode.UNSET}  # not a server error


class BrokenServicer:
    """Sends one token, then fails as a bug would."""

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(delta=pb.TextDelta(text="once"))
        raise RuntimeError("a bug in the servicer")


async def _read_broken_stream() -> grpc.aio.AioRpcError:
    server, port = await _start_server(BrokenServicer(), CallTracker(), InMemorySpanExporter())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _message in pb_grpc.GatewayServiceStub(channel).Generate(pb.GenerateRequest()):
                pass
    await server.stop(None)
    return raised.value


def test_a_servicer_error_mid_stream_is_still_internal_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        error = asyncio.run(_read_broken_stream())
    assert error.code() == grpc.StatusCode.INTERNAL and "see the server log" in error.details()
    logged = [r.exc_info[1] for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]
    assert [str(e) for e in logged if isinstance(e, RuntimeError)] == ["a bug in the servicer"]
