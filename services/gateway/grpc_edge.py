"""The gateway's gRPC face: the servicer's calls, with a refusal ending its call by status, not by raising.

A refusal is the expected answer to a bad or over-limit call, and under a flood it is the most
common one. An exception that left a handler used to cost the event loop milliseconds: the
OpenTelemetry server interceptor, which services/common/interceptors.py has since replaced,
formatted its whole traceback into the span, twice. The guard records no traceback for a refusal,
but an exception still unwinds through the handler and the guard, which then aborts the call.
Here a `ThermoclineError` ends the call with its status, message and trailing metadata set on the
context (the span still gets the status), so refusing a call costs no more than its checks.
Anything else still raises, and the server's interceptor answers INTERNAL and logs it. The HTTP
front calls the servicer itself, where refusals stay exceptions.

The server's write loop throws a cancellation that lands while a message is being written in at
the edge's `yield`; the edge passes it on to the servicer's stream, as `yield from` would, so the
servicer sees it where it stands and can end the call its own way (a stream the drain cut ends
UNAVAILABLE, audited).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc

from services.common.errors import ThermoclineError
from services.gateway.servicer import GatewayServicer
from thermocline.gateway.v1 import gateway_pb2 as pb
from thermocline.gateway.v1 import gateway_pb2_grpc as pb_grpc


def end_with(context: Any, error: ThermoclineError) -> None:
    """Sets the status `error` maps to on the call; the handler then returns."""
    context.set_code(error.code)
    context.set_details(error.message)
    if error.trailing_metadata:
        context.set_trailing_metadata(error.trailing_metadata)


class GrpcEdge(pb_grpc.GatewayServiceServicer):
    """The public gRPC API over the servicer that the HTTP front shares."""

    def __init__(self, servicer: GatewayServicer) -> None:
        self.servicer = servicer

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        messages: AsyncGenerator[pb.GenerateResponse, None] = self.servicer.Generate(request, context)
        try:
            async with contextlib.aclosing(messages):
                message = await anext(messages)
                while True:
                    try:
                        yield message
                    except asyncio.CancelledError as cancelled:  # thrown in by the write loop
                        message = await messages.athrow(cancelled)
                    else:
                        message = await anext(messages)
        except StopAsyncIteration:
            return
        except ThermoclineError as error:
            end_with(context, error)

    async def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        try:
            return await self.servicer.ListModels(request, context)
        except ThermoclineError as error:
            end_with(context, error)
            return pb.ListModelsResponse()  # not sent: the status is not OK


def add_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> str:
    """Serves `servicer` through the edge on `server`; returns the service's full name."""
    pb_grpc.add_GatewayServiceServicer_to_server(GrpcEdge(servicer), server)
    return pb.DESCRIPTOR.services_by_name["GatewayService"].full_name
