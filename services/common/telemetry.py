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

import logging

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased

from services.common import env

log = logging.getLogger(__name__)

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


def server_interceptor() -> grpc.aio.ServerInterceptor:
    """A server interceptor that continues the caller's trace and opens a span per RPC."""
    return aio_server_interceptor(filter_=_is_traced)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that open a span per outgoing RPC and inject `traceparent`."""
    return aio_client_interceptors(filter_=_is_traced)


def tracer(name: str) -> trace.Tracer:
    """A tracer for spans inside a service."""
    return trace.get_tracer(name)


def current_trace_id() -> str:
    """The trace id of the active span in hex, or '' when there is none."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""
