"""The server interceptor every service runs: drain gate, error mapping and RPC metrics.

A request message that does not parse (bad protobuf, invalid UTF-8 in a string) is answered
INVALID_ARGUMENT on every RPC, rather than grpc's UNKNOWN "Unexpected <class ...>".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.common import telemetry
from services.common.errors import InvalidArgument, ThermoclineError
from services.common.metrics import RPC_DURATION, RPC_HANDLED, RPC_IN_FLIGHT

log = logging.getLogger(__name__)

# Infrastructure RPCs bypass the drain gate: health must keep answering NOT_SERVING.
_INFRASTRUCTURE_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


class CallTracker:
    """Counts the calls in flight and says whether new ones are still admitted."""

    def __init__(self) -> None:
        self.num_in_flight = 0
        self.is_draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """Records the start of a call."""
        self.num_in_flight += 1
        self._idle.clear()
        RPC_IN_FLIGHT.inc()

    def exit(self) -> None:
        """Records the end of a call."""
        self.num_in_flight -= 1
        RPC_IN_FLIGHT.dec()
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no call is in flight; False when the timeout came first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Refuses new calls while draining, maps domain errors to statuses, and counts RPCs."""

    def __init__(self, tracker: CallTracker) -> None:
        self._tracker = tracker

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_INFRASTRUCTURE_PREFIXES):
            return handler
        return _wrap_handler(handler, _CallGuard(self._tracker, method))


class _CallGuard:
    """What happens around one RPC's behaviour."""

    def __init__(self, tracker: CallTracker, method: str) -> None:
        self.tracker = tracker
        self.method = method
        self.code: grpc.StatusCode | None = None

    async def admit(self, context: grpc.aio.ServicerContext) -> float:
        """Refuses the call while draining; otherwise starts counting it."""
        if self.tracker.is_draining:
            RPC_HANDLED.labels(self.method, grpc.StatusCode.UNAVAILABLE.name).inc()
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another replica"
            )
        self.tracker.enter()
        return time.perf_counter()

    def finish(self, started: float, code: grpc.StatusCode) -> None:
        """Stops counting the call and records its outcome."""
        self.tracker.exit()
        RPC_HANDLED.labels(self.method, code.name).inc()
        RPC_DURATION.labels(self.method).observe(time.perf_counter() - started)

    async def abort(self, context: grpc.aio.ServicerContext, error: Exception) -> None:
        """Ends the call with the status that `error` maps to; always raises AbortError."""
        if isinstance(error, ThermoclineError):
            code, message, trailing = error.code, error.message, error.trailing_metadata
        else:
            log.exception("unhandled error in %s", self.method)
            trace_id = telemetry.current_trace_id() or "none"
            code, message, trailing = (
                grpc.StatusCode.INTERNAL,
                f"internal error (trace id {trace_id}); see the server log",
                (),
            )
        self.code = code
        await context.abort(code, message, trailing_metadata=trailing)


def _code_of(context: grpc.aio.ServicerContext, guard: _CallGuard) -> grpc.StatusCode:
    """The status the call ended with, as far as the server knows it."""
    if guard.code is not None:
        return guard.code
    if context.cancelled():
        return grpc.StatusCode.CANCELLED
    code = context.code()
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK


class _Undecodable:
    """Stands in for a request message that did not parse, so the call can answer INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def refusal(self) -> InvalidArgument:
        """The status the caller gets."""
        return InvalidArgument(
            f"the request is not a valid protobuf message of this RPC's type ({self.error}); "
            "check the message type and that every string field is UTF-8"
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that hands back an _Undecodable instead of raising (grpc would answer UNKNOWN)."""
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as error:  # DecodeError, and invalid UTF-8 in a string field
            return _Undecodable(error)

    return deserialize


def _checked(request: Any, is_stream: bool) -> Any:
    """The request, or for a client stream an iterator over it, refusing any message that did not parse."""
    if is_stream:
        return _checked_stream(request)
    if isinstance(request, _Undecodable):
        raise request.refusal()
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request, is_stream=False)


def _wrap_unary(behavior: Callable[..., Any], guard: _CallGuard, is_stream: bool) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = await guard.admit(context)
        try:
            return await behavior(_checked(request, is_stream), context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as error:
            await guard.abort(context, error)
        finally:
            guard.finish(started, _code_of(context, guard))

    return wrapper


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], guard: _CallGuard, is_stream: bool
) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started = await guard.admit(context)
        try:
            async for response in behavior(_checked(request, is_stream), context):
                yield response
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as error:
            await guard.abort(context, error)
        finally:
            guard.finish(started, _code_of(context, guard))

    return wrapper


def _wrap_handler(handler: grpc.RpcMethodHandler, guard: _CallGuard) -> grpc.RpcMethodHandler:
    """Rebuilds `handler` with its behaviour wrapped by `guard`, keeping the serializers."""
    codecs = {
        "request_deserializer": _tolerant(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, guard, False), **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, guard, True), **codecs)
    if handler.unary_stream:
        # grpc's stubs type these as sync iterators; on an aio server they are async generators
        wrapped = _wrap_stream(handler.unary_stream, guard, False)  # type: ignore[arg-type]
        return grpc.unary_stream_rpc_method_handler(wrapped, **codecs)
    return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, guard, True), **codecs)  # type: ignore[arg-type]
