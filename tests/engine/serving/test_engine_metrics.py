"""Engine metrics: tier gauges, unit-suffixed counters, and the sampled hot attention mass."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.scheduling.sequence import StreamEvent
from services.engine.serving.engine_metrics import EngineCollector


def test_tiered_run_reports_tiers_hot_mass_and_usage(tiny_dir: Path) -> None:
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=16, warm_tokens=256, group_size=16)
    engine = LLMEngine.load(
        tiny_dir, device="cpu", max_batch_size=2, max_seq_len=256, progress=False, kv=KVCacheSpec(tiers=tiers)
    )
    events: list[StreamEvent] = []
    engine.submit(list(range(5, 45)), SamplingParams(max_new_tokens=120, ignore_eos=True), events.append)
    for _ in range(100):
        engine.step()
    stats = engine.stats()
    assert stats.num_warm_tokens > 0 and stats.warm_bytes > 0 and stats.hot_bytes > 0
    assert 0.0 < stats.hot_attention_mass < 1.0  # sampled on a decode step with warm tokens present
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    text = generate_latest(registry).decode()
    assert 'thermocline_engine_kv_tokens{tier="warm"}' in text
    assert 'thermocline_engine_kv_bytes{tier="hot"}' in text
    assert "thermocline_engine_generated_tokens_total 100" in text
    assert "thermocline_engine_preemptions_total 0" in text
    assert "tenant" not in text
    while not events[-1].finished:
        engine.step()
    usage = events[-1].usage
    assert usage is not None and usage.warm_tokens > 0 and 0 < usage.hot_tokens <= 4 + 16 + 16 + 16 + 16
