"""A finished request's timeline as OpenTelemetry spans and Prometheus latency observations.

The engine thread only stamps times (`sequence.Timeline`); this module runs on the servicer's
event loop after the final event (or when a stream ends before it), so span objects never enter
the decode loop. Child spans are built with explicit start and end timestamps: one per queue wait
(a preempted request waits again), one per prefill chunk, and one for decode, from the first token
to the finish.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context

from services.common import telemetry
from services.engine import metrics
from services.engine.scheduling.sequence import FinishReason, Interval, StreamEvent, Timeline

_tracer = telemetry.tracer("services.engine")


def record_finished(event: StreamEvent, intent_class: str, tracer: trace.Tracer | None = None) -> None:
    """Spans under the current (Generate) span, its events, and the request's latency metrics."""
    timeline = event.timeline
    if timeline is None:
        return
    parent = trace.get_current_span()
    _add_child_spans(tracer or _tracer, parent, timeline, event, intent_class)
    for timed in timeline.events:
        parent.add_event(timed.name, dict(timed.attributes), timestamp=timed.time_ns)
    _observe_latency(timeline, event, intent_class)


def record_cancelled(intent_class: str) -> None:
    """Counts a request whose stream ended before its final event was read (cancelled by its caller,
    past its deadline, or disconnected): it finished as `cancelled`, with no latency to observe."""
    metrics.REQUESTS.labels(intent_class, FinishReason.CANCELLED.value).inc()


def _add_child_spans(
    tracer: trace.Tracer, parent: trace.Span, timeline: Timeline, event: StreamEvent, intent_class: str
) -> None:
    context = trace.set_span_in_context(parent)
    for wait in timeline.queue_waits:
        _span(tracer, "engine.queue_wait", wait, context, {"thermocline.intent_class": intent_class})
    for index, chunk in enumerate(timeline.prefill_chunks):
        attributes = {"thermocline.prefill.chunk": index, "thermocline.prefill.tokens": chunk.num_tokens}
        _span(tracer, "engine.prefill", chunk, context, attributes)
    if timeline.first_token_ns is not None and timeline.finished_ns is not None:
        decode = Interval(timeline.first_token_ns, timeline.finished_ns)
        attributes = {"gen_ai.usage.output_tokens": event.completion_tokens}
        _span(tracer, "engine.decode", decode, context, attributes)


def _span(
    tracer: trace.Tracer, name: str, interval: Interval, context: Context, attributes: Mapping[str, str | int]
) -> None:
    span = tracer.start_span(name, context=context, start_time=interval.start_ns, attributes=attributes)
    span.end(end_time=max(interval.end_ns, interval.start_ns))


def _observe_latency(timeline: Timeline, event: StreamEvent, intent_class: str) -> None:
    reason = event.finish_reason.value if event.finish_reason is not None else "unknown"
    metrics.REQUESTS.labels(intent_class, reason).inc()
    if timeline.finished_ns is None:
        return
    metrics.REQUEST_LATENCY.labels(intent_class).observe(_seconds(timeline.finished_ns - timeline.arrival_ns))
    if timeline.first_token_ns is None:
        return
    metrics.TIME_TO_FIRST_TOKEN.labels(intent_class).observe(
        _seconds(timeline.first_token_ns - timeline.arrival_ns)
    )
    if event.completion_tokens > 1:
        decode_ns = timeline.finished_ns - timeline.first_token_ns
        per_token_s = _seconds(decode_ns) / (event.completion_tokens - 1)
        metrics.TIME_PER_OUTPUT_TOKEN.labels(intent_class).observe(per_token_s)


def _seconds(duration_ns: int) -> float:
    return max(duration_ns, 0) / 1e9
