"""A request's engine timeline becomes child spans with explicit times, events and latency metrics."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.sequence import StreamEvent
from services.engine.serving.request_trace import record_finished

NUM_PROMPT = 40
NUM_NEW = 60


def _run_one_request(tiny_dir: Path) -> StreamEvent:
    """A tiered engine that prefills in 16-token chunks and demotes to warm while decoding."""
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=16, warm_tokens=256, group_size=16)
    engine = LLMEngine.load(
        tiny_dir, device="cpu", max_batch_size=2, max_seq_len=256, progress=False,
        kv=KVCacheSpec(tiers=tiers), max_prefill_tokens=16,
    )  # fmt: skip
    events: list[StreamEvent] = []
    params = SamplingParams(max_new_tokens=NUM_NEW, ignore_eos=True)
    engine.submit(list(range(5, 5 + NUM_PROMPT)), params, events.append, intent_class="interactive")
    engine.step()
    engine.scheduler.running[0].add_event("thermocline.safety.check", {"thermocline.safety.score": 0.1})
    while not events or not events[-1].finished:
        engine.step()
    return events[-1]


def test_timeline_becomes_queue_prefill_and_decode_spans_under_the_rpc_span(tiny_dir: Path) -> None:
    final = _run_one_request(tiny_dir)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    before = REGISTRY.get_sample_value(
        "thermocline_engine_time_to_first_token_seconds_count", {"intent_class": "interactive"}
    )
    with tracer.start_as_current_span("Generate") as parent:
        record_finished(final, "interactive", tracer)
    spans: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    rpc = spans["Generate"][0]
    (queue,) = spans["engine.queue_wait"]
    prefills = sorted(spans["engine.prefill"], key=lambda s: s.start_time)
    (decode,) = spans["engine.decode"]
    for child in (queue, *prefills, decode):
        assert child.parent is not None and child.parent.span_id == parent.get_span_context().span_id
        assert child.context.trace_id == rpc.context.trace_id
        assert child.start_time <= child.end_time
    assert [s.attributes["thermocline.prefill.tokens"] for s in prefills] == [16, 16, 8]
    assert queue.end_time <= prefills[0].start_time
    assert prefills[-1].end_time <= decode.start_time <= decode.end_time
    assert decode.attributes["gen_ai.usage.output_tokens"] == NUM_NEW
    names = [e.name for e in rpc.events]
    assert "thermocline.safety.check" in names
    assert "thermocline.kv.demotion" in names  # hot keeps 4 sink + 16 recent tokens; the rest go warm
    after = REGISTRY.get_sample_value(
        "thermocline_engine_time_to_first_token_seconds_count", {"intent_class": "interactive"}
    )
    assert after == (before or 0) + 1
    assert REGISTRY.get_sample_value(
        "thermocline_engine_time_per_output_token_seconds_count", {"intent_class": "interactive"}
    )
