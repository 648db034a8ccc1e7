"""The server span that every service's interceptor opens: it continues the caller's trace, is
current inside the handler, and ends with the call's status, as the OpenTelemetry instrumentation's
span would; health checks get none."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.errors import InvalidArgument
from services.common.interceptors import CallTracker, GuardInterceptor

SERVICE = "thermocline.test.Spans"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"


async def _ok(request: bytes, context: Any) -> bytes:
    return request


async def _crash(request: bytes, context: Any) -> bytes:
    raise RuntimeError("a bug in the handler")


async def _refuse(request: bytes, context: Any) -> bytes:
    raise InvalidArgument("prompt is empty; send some text")


async def _stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    for _ in range(2):  # the span current inside the handler, as the servicers see it
        yield format(trace.get_current_span().get_span_context().span_id, "016x").encode()


HANDLERS = {
    "Ok": grpc.unary_unary_rpc_method_handler(_ok),
    "Crash": grpc.unary_unary_rpc_method_handler(_crash),
    "Refuse": grpc.unary_unary_rpc_method_handler(_refuse),
    "Stream": grpc.unary_stream_rpc_method_handler(_stream),  # type: ignore[arg-type]
}


async def _serve_and_call() -> tuple[dict[str, Any], list[ReadableSpan]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = grpc.aio.server(interceptors=[GuardInterceptor(CallTracker(), tracer_provider=provider)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, HANDLERS)])
    checker = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    traceparent = (("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"),)
    outcomes: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        outcomes["Ok"] = await channel.unary_unary(f"/{SERVICE}/Ok")(b"hi", metadata=traceparent)
        for name in ("Crash", "Refuse"):
            try:
                await channel.unary_unary(f"/{SERVICE}/{name}")(b"hi")
            except grpc.aio.AioRpcError as error:
                outcomes[name] = error.code()
        call = channel.unary_stream(f"/{SERVICE}/Stream")(b"hi")
        outcomes["Stream"] = [message async for message in call]
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    await server.stop(None)
    return outcomes, list(exporter.get_finished_spans())


def test_each_call_has_one_server_span_that_ends_with_its_status() -> None:
    outcomes, spans = asyncio.run(_serve_and_call())
    assert outcomes["Ok"] == b"hi"
    assert outcomes["Crash"] == grpc.StatusCode.INTERNAL
    assert outcomes["Refuse"] == grpc.StatusCode.INVALID_ARGUMENT
    by_method = {span.name.rsplit("/", 1)[-1]: span for span in spans}
    assert sorted(by_method) == ["Crash", "Ok", "Refuse", "Stream"]  # no span for the health check
    assert len(spans) == 4

    ok = by_method["Ok"]
    assert ok.kind == trace.SpanKind.SERVER
    assert format(ok.context.trace_id, "032x") == TRACE_ID  # the caller's trace, continued
    assert ok.parent is not None and format(ok.parent.span_id, "016x") == CALLER_SPAN_ID
    attributes = dict(ok.attributes or {})
    assert attributes["rpc.system"] == "grpc"
    assert (attributes["rpc.service"], attributes["rpc.method"]) == (SERVICE, "Ok")
    assert attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert attributes["net.peer.ip"] == "127.0.0.1" and attributes["net.peer.name"] == "localhost"
    assert ok.status.status_code == trace.StatusCode.UNSET

    crash = by_method["Crash"]  # the server's error: marked, with the exception recorded
    assert dict(crash.attributes or {})["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    assert crash.status.status_code == trace.StatusCode.ERROR
    assert [event.name for event in crash.events] == ["exception"]

    refuse = by_method["Refuse"]  # the caller's error: the status code, no error, no exception
    assert dict(refuse.attributes or {})["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert refuse.status.status_code == trace.StatusCode.UNSET
    assert not refuse.events

    stream = by_method["Stream"]  # current in the handler across its messages, ended after them
    own_id = format(stream.context.span_id, "016x").encode()
    assert outcomes["Stream"] == [own_id, own_id]
    assert format(stream.context.trace_id, "032x") != TRACE_ID  # no traceparent sent: a new trace


async def _endless(request: bytes, context: Any) -> AsyncIterator[bytes]:
    while True:  # never awaits: the handler waits at its `yield` while the client's window is full
        yield b"x" * 1024


async def _cancel_streams(num_calls: int) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = grpc.aio.server(interceptors=[GuardInterceptor(CallTracker(), tracer_provider=provider)])
    handlers = {"Endless": grpc.unary_stream_rpc_method_handler(_endless)}  # type: ignore[arg-type]
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        for _ in range(num_calls):
            call = channel.unary_stream(f"/{SERVICE}/Endless")(b"hi")
            async for _message in call:
                break
            call.cancel()
        deadline = time.monotonic() + 30
        while len(exporter.get_finished_spans()) < num_calls:  # each ends as its call's task is cancelled
            assert time.monotonic() < deadline, "a cancelled stream's span never ended"
            await asyncio.sleep(0)
    await server.stop(None)
    return list(exporter.get_finished_spans())


def test_a_stream_its_client_cancels_ends_its_span_without_an_error_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        spans = asyncio.run(_cancel_streams(10))
    assert len(spans) == 10
    codes = {dict(s.attributes or {})["rpc.grpc.status_code"] for s in spans}
    assert codes == {grpc.StatusCode.CANCELLED.value[0]}, codes
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
