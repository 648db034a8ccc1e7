"""The server interceptor every service runs: the call's server span, drain gate, error mapping and
RPC metrics.

A request message that does not parse (bad protobuf, invalid UTF-8 in a string) is answered
INVALID_ARGUMENT on every RPC, rather than grpc's UNKNOWN "Unexpected <class ...>".

The span is the one opentelemetry-instrumentation-grpc's server interceptor would open: named for
the method, a SERVER span continuing the caller's `traceparent`, with the same rpc.* and net.peer.*
attributes and the status it would set. It is opened here rather than by a second interceptor
because each interceptor costs every call: another handler wrapper, another async generator that
every streamed message passes through, and the instrumentation's proxy around the servicer
context, through which every call on the context goes. Health checks and reflection get neither
span nor guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from grpc._cython import cygrpc  # type: ignore[attr-defined]  # ExecuteBatchError: a failed batch
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from prometheus_client import Gauge

from services.common import telemetry
from services.common.errors import InvalidArgument, ThermoclineError
from services.common.metrics import RPC_DURATION, RPC_HANDLED, RPC_IN_FLIGHT

log = logging.getLogger(__name__)

# Infrastructure RPCs bypass the drain gate (health must keep answering NOT_SERVING) and get no
# span (they would drown the real traffic).
_INFRASTRUCTURE_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
_DRAINING = "server is shutting down; retry on another replica"
# How long a stream whose write failed waits for the core to report that its client closed the call;
# the report comes in the same moment as the failure, so this bounds only a failure of another kind.
CLIENT_CLOSE_WAIT_S = 5.0


class CallTracker:
    """Counts the calls in flight and says whether new ones are still admitted.

    A call is in flight until grpc has finished it: its status sent (or the call cancelled), not
    only its handler returned. A stream's last messages and its status can wait behind a client
    that reads slowly; a drain that stopped the server as soon as the handlers returned would cut
    them off (a stream the drain cut would lose the status that says so).

    The gRPC server's tracker keeps `gauge` (RPCs in flight). A service that serves calls besides
    its gRPC ones (the gateway's HTTP front) counts those in a tracker of their own, without it, for
    the drain to wait on too (ServiceSpec.other_calls)."""

    def __init__(self, gauge: Gauge | None = RPC_IN_FLIGHT) -> None:
        self.num_in_flight = 0
        self.is_draining = False
        self.gauge = gauge
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """Records the start of a call."""
        self.num_in_flight += 1
        self._idle.clear()
        if self.gauge is not None:
            self.gauge.inc()

    def exit(self) -> None:
        """Records the end of a call."""
        self.num_in_flight -= 1
        if self.gauge is not None:
            self.gauge.dec()
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float, *others: CallTracker) -> bool:
        """Waits until no call is in flight, here or in `others`; False when the timeout came first."""
        try:
            async with asyncio.timeout(timeout_s):
                while busy := [tracker for tracker in (self, *others) if tracker.num_in_flight]:
                    await busy[0]._idle.wait()
            return True
        except TimeoutError:
            return False


# The statuses the instrumentation marks as a server span's error; the others leave it unset
# (a refused call is the caller's error, not the server's).
_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
_STATUS_CODE = "rpc.grpc.status_code"


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Opens each call's server span, refuses new calls while draining, maps domain errors to
    statuses, and counts RPCs."""

    def __init__(self, tracker: CallTracker, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracker = tracker
        self._tracer = trace.get_tracer("thermocline.grpc.server", tracer_provider=tracer_provider)
        # method -> (the servicer's handler, its wrapped handler): grpc asks for the handler on
        # every call, and a servicer hands back the same one, so it is wrapped once per method.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_INFRASTRUCTURE_PREFIXES):
            return handler
        wrapped = self._wrapped.get(method)
        if wrapped is None or wrapped[0] is not handler:
            wrapped = (handler, _wrap_handler(handler, _MethodGuard(self._tracker, self._tracer, method)))
            self._wrapped[method] = wrapped
        return wrapped[1]


class _MethodGuard:
    """What every call of one method shares: its tracker, tracer and span attributes."""

    def __init__(self, tracker: CallTracker, tracer: trace.Tracer, method: str) -> None:
        self.tracker = tracker
        self.tracer = tracer
        self.method = method
        service, name = method.lstrip("/").split("/", 1)
        self.attributes: dict[str, str | int] = {
            "rpc.system": "grpc",
            _STATUS_CODE: grpc.StatusCode.OK.value[0],
            "rpc.method": name,
            "rpc.service": service,
        }

    def call(self, context: grpc.aio.ServicerContext) -> _CallGuard:
        """Opens the server span of one call, current until the call's guard closes it."""
        metadata = context.invocation_metadata()
        parent = propagate.extract(dict(metadata)) if metadata else None
        attributes = dict(self.attributes)
        attributes.update(_peer_attributes(context.peer()))
        span = self.tracer.start_span(
            self.method, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        return _CallGuard(self, span, token)


def _peer_attributes(peer: str) -> dict[str, str]:
    """net.peer.* of a peer such as `ipv4:127.0.0.1:57284` or `ipv6:[::1]:57284`, as the
    instrumentation records them; none for a Unix socket or an unknown form."""
    try:
        ip, port = peer.split(",")[0].split(":", 1)[1].rsplit(":", 1)
    except (IndexError, ValueError):
        return {}
    if peer.startswith("unix"):
        return {}
    attributes = {"net.peer.ip": ip, "net.peer.port": port}
    if ip in ("[::1]", "127.0.0.1"):
        attributes["net.peer.name"] = "localhost"
    return attributes


def _detach(token: object) -> None:
    """Restores the context from before the call's span was made current. A call closed outside its
    own task (a stream handler left at a `yield` for the event loop's async-generator finalizer, as
    grpc once left them) runs this in another task's context, where the token cannot be reset and
    OpenTelemetry's `detach` logs an ERROR with a traceback; the call's own context went with its
    task, so there is nothing to restore. Streams are now written and closed in their task
    (_write_all); this stays tolerant for any handler that is not."""
    if isinstance(token, contextvars.Token):  # what OpenTelemetry's default runtime context hands out
        with contextlib.suppress(ValueError):
            token.var.reset(token)
    else:
        otel_context.detach(token)  # type: ignore[arg-type]


class _CallGuard:
    """What happens around one RPC's behaviour."""

    def __init__(self, method: _MethodGuard, span: trace.Span, token: object) -> None:
        self.tracker = method.tracker
        self.method = method.method
        self.span = span
        self._token = token
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def admit(self, context: grpc.aio.ServicerContext) -> float:
        """Refuses the call while draining; otherwise starts counting it."""
        if self.tracker.is_draining:
            RPC_HANDLED.labels(self.method, grpc.StatusCode.UNAVAILABLE.name).inc()
            self.code, self.details = grpc.StatusCode.UNAVAILABLE, _DRAINING
            await context.abort(grpc.StatusCode.UNAVAILABLE, _DRAINING)
        self.tracker.enter()
        context.add_done_callback(self._finished_by_grpc)  # type: ignore[arg-type]  # stubs: a class
        return time.perf_counter()

    def _finished_by_grpc(self, context: grpc.aio.ServicerContext) -> None:
        """Stops counting the call, once its status is out."""
        self.tracker.exit()

    def finish(self, started: float, code: grpc.StatusCode) -> None:
        """Records the outcome of the call's handler."""
        RPC_HANDLED.labels(self.method, code.name).inc()
        RPC_DURATION.labels(self.method).observe(time.perf_counter() - started)

    def close(self, context: grpc.aio.ServicerContext) -> None:
        """Ends the call's span with the status the call ended with."""
        code = _code_of(context, self)
        self.span.set_attribute(_STATUS_CODE, code.value[0])
        if code in _SERVER_ERRORS:
            details = self.details or context.details() or code.value[1]
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}:{details}"))
        self.span.end()
        _detach(self._token)

    async def abort(self, context: grpc.aio.ServicerContext, error: Exception) -> None:
        """Ends the call with the status that `error` maps to; always raises AbortError."""
        if isinstance(error, ThermoclineError):
            code, message, trailing = error.code, error.message, error.trailing_metadata
        else:
            log.exception("unhandled error in %s", self.method)
            self.span.record_exception(error)
            trace_id = telemetry.current_trace_id() or "none"
            code, message, trailing = (
                grpc.StatusCode.INTERNAL,
                f"internal error (trace id {trace_id}); see the server log",
                (),
            )
        self.code, self.details = code, message
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


def _wrap_unary(behavior: Callable[..., Any], method: _MethodGuard, is_stream: bool) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        guard = method.call(context)
        try:
            started = await guard.admit(context)
            try:
                return await behavior(_checked(request, is_stream), context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as error:
                await guard.abort(context, error)
            finally:
                guard.finish(started, _code_of(context, guard))
        finally:
            guard.close(context)

    return wrapper


def _wrap_stream(
    behavior: Callable[..., AsyncGenerator[Any, None]], method: _MethodGuard, is_stream: bool
) -> Callable[..., Any]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> None:
        guard = method.call(context)
        try:
            started = await guard.admit(context)
            try:
                await _write_all(behavior(_checked(request, is_stream), context), context)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                guard.code = guard.code or grpc.StatusCode.CANCELLED  # the client left, or a timer ended it
                raise
            except cygrpc.ExecuteBatchError as error:
                await _wait_for_client_close(guard, error)
            except Exception as error:
                await guard.abort(context, error)
            finally:
                guard.finish(started, _code_of(context, guard))
        finally:
            guard.close(context)

    return wrapper


async def _write_all(responses: AsyncGenerator[Any, None], context: grpc.aio.ServicerContext) -> None:
    """Sends each response with `context.write`, then closes `responses` in this call's task.

    The stream is written here rather than handed to grpc as an async generator, because grpc's own
    loop writes a generator's messages outside the handler: a write that fails because the client
    went away while it waited (its window full, then the stream or connection closed) raised out of
    grpc's loop, which logged "ExecuteBatchError raised in core by servicer method" with a traceback
    for every such stream, and the handler was left at its `yield` for the loop's finalizer to close
    in another task. Here the failure reaches the guard, and the servicer's cleanup runs at once.

    A cancellation of the call's task that lands while a write waits (a client reading slowly, a
    handler's timer, a drain that cuts the stream) is thrown into the handler at its `yield`, where
    it stands, as one that lands in an await of its own is: its scopes see it (an `asyncio.timeout`
    turns it into its own error, the gateway's stream cut into its status) instead of a bare close.
    """
    async with contextlib.aclosing(responses):
        async for response in responses:
            await _write(response, responses, context)


async def _write(
    response: Any, responses: AsyncGenerator[Any, None], context: grpc.aio.ServicerContext
) -> None:
    """Writes `response`, handing a cancellation that comes meanwhile to `responses`; writes what it
    yields instead, should it carry on. The interrupted message stays queued in the core: a client
    that reads on gets it before the call's status."""
    while True:
        try:
            await context.write(response)
            return
        except asyncio.CancelledError as cancelled:
            try:
                response = await responses.athrow(cancelled)
            except StopAsyncIteration:
                return


async def _wait_for_client_close(guard: _CallGuard, error: Exception) -> NoReturn:
    """A write failed in the core. When the client closed the call, the core says so within moments
    by cancelling this task, and the call ends CANCELLED (counted, and logged by grpc at DEBUG only).
    A failure without a close is re-raised for grpc to log: it is not the client going away."""
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLIENT_CLOSE_WAIT_S):
                await asyncio.get_running_loop().create_future()  # nobody resolves it: a cancel ends it
    except asyncio.CancelledError:
        guard.code = grpc.StatusCode.CANCELLED
        log.debug("%s: the client went away while a message waited to be sent", guard.method)
        raise
    raise error


def _wrap_handler(handler: grpc.RpcMethodHandler, guard: _MethodGuard) -> grpc.RpcMethodHandler:
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
