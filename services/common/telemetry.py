"""OpenTelemetry set-up: one tracer provider per process, W3C context in gRPC metadata.

Spans are exported over OTLP/gRPC whenever `OTEL_EXPORTER_OTLP_ENDPOINT` (or the traces-only
variant) is set; otherwise they are created (so trace ids still reach the client) but dropped.
Sampling follows the standard `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` variables, and
the default parent-based sampler honours the sampled flag of an incoming `traceparent`.
`THERMOCLINE_TRACE_SAMPLE_RATIO` is the short form: parent-based, sampling that share of new
traces (the gateway's roots), while every downstream hop follows its caller's decision.
Redis commands (the gateway's rate limits, the kvstore's index) become client spans through
opentelemetry-instrumentation-redis.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

from services.common import env, tasks

log = logging.getLogger(__name__)

Stub = TypeVar("Stub")

_provider: TracerProvider | None = None


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the global tracer provider for this process, exporting over OTLP when configured."""
    global _provider
    if _provider is not None:
        return _provider
    resource = Resource.create({SERVICE_NAME: f"thermocline-{service_name}"})
    provider = TracerProvider(resource=resource, sampler=_sampler())
    endpoint = env.otlp_endpoint()
    if endpoint is not None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        log.info("exporting traces over OTLP to %s", endpoint)
    trace.set_tracer_provider(provider)
    _instrument_redis()
    _provider = provider
    return provider


def _sampler() -> Sampler | None:
    """Parent-based ratio sampling when THERMOCLINE_TRACE_SAMPLE_RATIO is set; else the SDK reads OTEL_*."""
    ratio = env.trace_sample_ratio()
    return None if ratio is None else ParentBased(TraceIdRatioBased(ratio))


def _instrument_redis() -> None:
    """Every redis-py client in the process (sync and asyncio) opens a client span per command."""
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    instrumentor = RedisInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()


def shutdown_tracing() -> None:
    """Flushes and stops the exporter; call once at process exit."""
    if _provider is not None:
        _provider.shutdown()


# Health checks and reflection make no spans: they would drown the real traffic.
_UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _is_traced(details: object) -> bool:
    """Whether a call (server handler details or client call details) gets a span.

    The instrumentation's own filters find the method through isinstance checks against gRPC's
    protocol classes; this reads `method`, which every details object the interceptors pass has
    (str, or bytes on some client paths). In the gateway that took about 0.05 ms off each RPC's
    share of its own time (bench/results/gateway_spans_2026-12-05_span-filter.md).
    """
    method = getattr(details, "method", "")
    if isinstance(method, bytes):
        method = method.decode()
    return not method.startswith(_UNTRACED_PREFIXES)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that open a span per outgoing RPC and inject `traceparent`."""
    return aio_client_interceptors(filter_=_is_traced)


def traced_stub(
    stub: Stub, service: ServiceDescriptor, tracer_provider: trace.TracerProvider | None = None
) -> Stub:
    """`stub` (of `service`, on a channel opened with `trace_calls=False`) with each call opening
    its client span itself, as the client interceptor would: the same name, kind, attributes and
    status, and the same `traceparent` sent.

    The point is the cost. An intercepted aio call runs its interceptor in a task of its own and a
    streamed one reads every message through the interceptor's generator; a call traced here is
    the plain call plus its span: about 0.1 ms less a call on a small box, three or more times per
    request on the gateway's path (bench/results/gateway_spans_2026-12-05_own-spans.md). A unary
    call returns an awaitable of the reply, as before; a server-streaming one returns the call,
    whose span ends with its status (read the stream to its end, or cancel it).
    """
    tracer = trace.get_tracer("thermocline.grpc.client", tracer_provider=tracer_provider)
    traced = _TracedStub()
    for method in service.methods:
        multicallable = getattr(stub, method.name)
        if method.client_streaming:  # none on a traced path; left as is rather than half traced
            setattr(traced, method.name, multicallable)
            continue
        path = f"/{service.full_name}/{method.name}"
        calls = _stream_call if method.server_streaming else _unary_call
        setattr(traced, method.name, functools.partial(calls, tracer, multicallable, path))
    return traced  # type: ignore[return-value]  # it has every method of Stub, called the same way


class _TracedStub:
    """The methods of a stub, each traced by traced_stub."""


_RPC_STATUS_CODE = "rpc.grpc.status_code"


def _client_span(tracer: trace.Tracer, method: str) -> tuple[trace.Span, tuple[tuple[str, str], ...]]:
    """The client span of a call to `method` (`/package.Service/Method`), child of the current
    span, and the metadata that carries it."""
    service, name = method.lstrip("/").split("/", 1)
    attributes: dict[str, str | int] = {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": name,
        _RPC_STATUS_CODE: 0,
    }
    span = tracer.start_span(method, kind=trace.SpanKind.CLIENT, attributes=attributes)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, tuple(carrier.items())


def _add_metadata(kwargs: dict[str, Any], metadata: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    if metadata:
        kwargs["metadata"] = tuple(kwargs.get("metadata") or ()) + metadata
    return kwargs


def _end_with_status(
    span: trace.Span, code: grpc.StatusCode, details: str | None, is_error: bool = True
) -> None:
    """Ends a client span with the call's status; a status other than OK is an error unless the
    caller itself cancelled the call (an output block, a prompt blocked under trailing, a caller
    gone), which the interceptor did not mark as an error either."""
    span.set_attribute(_RPC_STATUS_CODE, code.value[0])
    if code != grpc.StatusCode.OK and is_error:
        span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {details}"))
    span.end()


async def _unary_call(
    tracer: trace.Tracer, multicallable: Any, method: str, request: Any, **kwargs: Any
) -> Any:
    span, metadata = _client_span(tracer, method)
    try:
        reply = await multicallable(request, **_add_metadata(kwargs, metadata))
    except grpc.aio.AioRpcError as error:
        span.record_exception(error)
        _end_with_status(span, error.code(), error.details())
        raise
    except asyncio.CancelledError:
        _end_with_status(span, grpc.StatusCode.CANCELLED, "the caller cancelled the call", is_error=False)
        raise
    except BaseException as error:  # e.g. the channel closed under the call: the span still ends
        span.record_exception(error)
        _end_with_status(span, grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}")
        raise
    _end_with_status(span, grpc.StatusCode.OK, None)
    return reply


def _stream_call(tracer: trace.Tracer, multicallable: Any, method: str, request: Any, **kwargs: Any) -> Any:
    span, metadata = _client_span(tracer, method)
    try:
        call = multicallable(request, **_add_metadata(kwargs, metadata))
    except BaseException as error:
        span.record_exception(error)
        _end_with_status(span, grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}")
        raise
    call.add_done_callback(functools.partial(_end_stream_span, span))
    return call


def _end_stream_span(span: trace.Span, call: Any) -> None:
    """A streamed call's done callback: its status is known but only awaitable, so a task reads it
    (right away: the call is over) and ends the span."""
    tasks.hold(asyncio.ensure_future(_end_after_status(span, call)))


async def _end_after_status(span: trace.Span, call: Any) -> None:
    _end_with_status(span, await call.code(), await call.details(), is_error=not call.cancelled())


def tracer(name: str) -> trace.Tracer:
    """A tracer for spans inside a service."""
    return trace.get_tracer(name)


def current_trace_id() -> str:
    """The trace id of the active span in hex, or '' when there is none."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""
