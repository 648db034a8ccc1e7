"""telemetry.traced_stub: calls traced without an interceptor, as the interceptor traced them.

A real aio server (gRPC's health service) on loopback, traced by the server interceptor; the
client's stub on a channel without interceptors, wrapped by traced_stub. Both export to one
in-memory exporter.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import telemetry
from services.common.channels import open_channel

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]


class _Traced:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def spans(self, name: str, kind: trace.SpanKind) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name and s.kind == kind]


Scenario = Callable[[_Traced, health_pb2_grpc.HealthStub], Awaitable[None]]


def _run(scenario: Scenario) -> None:
    async def main() -> None:
        async with _served() as (traced, stub):
            await scenario(traced, stub)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _served() -> AsyncIterator[tuple[_Traced, health_pb2_grpc.HealthStub]]:
    traced = _Traced()
    # The server traces Check only: the instrumentation cannot wrap the health servicer's Watch,
    # which writes through its context instead of yielding.
    is_check = lambda details: details.method.endswith("/Check")  # noqa: E731
    interceptor = aio_server_interceptor(tracer_provider=traced.provider, filter_=is_check)
    server = grpc.aio.server(interceptors=[interceptor])
    servicer = health.aio.HealthServicer()
    await servicer.set("serving", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = open_channel(f"127.0.0.1:{port}", trace_calls=False)
    stub = telemetry.traced_stub(health_pb2_grpc.HealthStub(channel), HEALTH, traced.provider)
    try:
        yield traced, stub
    finally:
        await channel.close(grace=None)
        await server.stop(grace=None)


def _attributes(span: ReadableSpan) -> dict[str, object]:
    return dict(span.attributes or {})


def test_a_unary_call_has_the_interceptors_span_and_carries_it_to_the_server() -> None:
    _run(_unary)


async def _unary(traced: _Traced, stub: health_pb2_grpc.HealthStub) -> None:
    tracer = traced.provider.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="serving"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    (client,) = traced.spans("/grpc.health.v1.Health/Check", trace.SpanKind.CLIENT)
    (server,) = traced.spans("/grpc.health.v1.Health/Check", trace.SpanKind.SERVER)
    assert client.parent is not None and client.parent.span_id == caller.get_span_context().span_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.context.trace_id == caller.get_span_context().trace_id
    assert _attributes(client) == {
        "rpc.system": "grpc",
        "rpc.service": "grpc.health.v1.Health",
        "rpc.method": "Check",
        "rpc.grpc.status_code": 0,
    }
    assert client.status.status_code == trace.StatusCode.UNSET


def test_a_failed_unary_call_ends_its_span_with_the_status() -> None:
    _run(_failed_unary)


async def _failed_unary(traced: _Traced, stub: health_pb2_grpc.HealthStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=5)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    (client,) = traced.spans("/grpc.health.v1.Health/Check", trace.SpanKind.CLIENT)
    assert _attributes(client)["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert client.status.status_code == trace.StatusCode.ERROR
    assert [e.name for e in client.events] == ["exception"]


def test_a_streamed_call_is_the_plain_call_and_its_span_ends_with_its_status() -> None:
    _run(_streamed)


async def _streamed(traced: _Traced, stub: health_pb2_grpc.HealthStub) -> None:
    call = stub.Watch(health_pb2.HealthCheckRequest(service="serving"), timeout=5)
    assert isinstance(call, grpc.aio.UnaryStreamCall)  # not an intercepted call: no extra task
    first = await call.read()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    assert not traced.spans("/grpc.health.v1.Health/Watch", trace.SpanKind.CLIENT)  # still open
    call.cancel()
    assert await call.code() == grpc.StatusCode.CANCELLED
    # The span ends in a task that the call's done callback starts: give the loop a few turns.
    for _ in range(100):
        if traced.spans("/grpc.health.v1.Health/Watch", trace.SpanKind.CLIENT):
            break
        await asyncio.sleep(0)
    (client,) = traced.spans("/grpc.health.v1.Health/Watch", trace.SpanKind.CLIENT)
    assert _attributes(client)["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert client.status.status_code == trace.StatusCode.UNSET  # the caller's own cancel: no error
