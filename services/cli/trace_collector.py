"""A small in-process OTLP/gRPC trace receiver: the demo prints hop timings from it, and the tests
check that spans link up across processes. Production sends OTLP to Jaeger instead."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class CollectedSpan:
    """One received span, flattened."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)  # name -> time (ns) of its first occurrence

    @property
    def duration_ms(self) -> float:
        """Wall time of the span in milliseconds."""
        return (self.end_ns - self.start_ns) / 1e6


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _first_events(events: Any) -> dict[str, int]:
    first: dict[str, int] = {}
    for event in events:
        first.setdefault(event.name, event.time_unix_nano)
    return first


def _flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[CollectedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", "unknown"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    CollectedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        service=service,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=_first_events(span.events),
                    )
                )
    return spans


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """Receives OTLP trace exports on a loopback port and keeps the spans in memory."""

    def __init__(self) -> None:
        self._spans: list[CollectedSpan] = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        """The value for OTEL_EXPORTER_OTLP_ENDPOINT."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TraceCollector:
        """Starts receiving."""
        self._server.start()
        return self

    def stop(self) -> None:
        """Stops receiving."""
        self._server.stop(grace=None)

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._changed:
            self._spans.extend(_flatten(request))
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def span_names(self) -> set[tuple[str, str]]:
        """(service, span name) of every span received so far, of every trace."""
        with self._changed:
            return {(s.service, s.name) for s in self._spans}

    def spans(self, trace_id: str) -> list[CollectedSpan]:
        """The spans received so far for one trace, by start time."""
        with self._changed:
            return sorted((s for s in self._spans if s.trace_id == trace_id), key=lambda s: s.start_ns)

    def wait_for_spans(
        self, trace_id: str, required: set[tuple[str, str]], timeout_s: float
    ) -> list[CollectedSpan]:
        """Waits until spans named (service, span name) in `required` have arrived; returns the trace."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                spans = [s for s in self._spans if s.trace_id == trace_id]
                missing = required - {(s.service, s.name) for s in spans}
                if not missing:
                    return sorted(spans, key=lambda s: s.start_ns)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"trace {trace_id}: no spans yet for {sorted(missing)}")
                self._changed.wait(remaining)


GATEWAY_GENERATE = ("thermocline-gateway", "/thermocline.gateway.v1.GatewayService/Generate")
ENGINE_GENERATE = ("thermocline-engine", "/thermocline.engine.v1.EngineService/Generate")
GATEWAY_TO_ENGINE = ("thermocline-gateway", "/thermocline.engine.v1.EngineService/Generate")
GATEWAY_TO_SAFETY = ("thermocline-gateway", "/thermocline.safety.v1.SafetyService/CheckPrompt")
SAFETY_CHECK_PROMPT = ("thermocline-safety", "/thermocline.safety.v1.SafetyService/CheckPrompt")
# The spans of one request's whole path, gateway → safety → engine.
REQUEST_PATH = {GATEWAY_GENERATE, GATEWAY_TO_SAFETY, SAFETY_CHECK_PROMPT, GATEWAY_TO_ENGINE, ENGINE_GENERATE}


def format_trace(spans: list[CollectedSpan]) -> str:
    """The spans of one trace as an indented tree with the time spent in each."""
    children: dict[str, list[CollectedSpan]] = {}
    ids = {s.span_id for s in spans}
    for span in spans:
        parent = span.parent_span_id if span.parent_span_id in ids else ""
        children.setdefault(parent, []).append(span)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in children.get(parent, []):
            label = f"{'  ' * depth}{span.service.removeprefix('thermocline-')}: {span.name}"
            lines.append(f"{label:<72} {span.duration_ms:9.1f} ms")
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
