"""The gRPC edge: a refusal reaches the caller as its status, and the trace records no exception for it.

The server here has the interceptor every service runs (the guard, which opens the call's span), with
an in-memory span exporter, and the edge in front of a servicer stand-in that refuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes.rpc_attributes import RPC_GRPC_STATUS_CODE

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


async def _call_through_edge(servicer: RefusingServicer) -> tuple[list[Any], list[ReadableSpan]]:
    """Generate and ListModels through a server built as the services build theirs; outcomes and spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = grpc.aio.server(interceptors=[GuardInterceptor(CallTracker(), tracer_provider=provider)])
    add_to_server(servicer, server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
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
