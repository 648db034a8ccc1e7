"""The INT4 quantization-error estimate: measured on held hot KV, zero for exactly representable KV."""

from __future__ import annotations

from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, generate_latest

from services.engine.kv.quant_error import QuantizationErrorEstimator
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.llm_engine import LLMEngine
from services.engine.scheduling.sampling_params import SamplingParams
from services.engine.serving.engine_metrics import EngineCollector


def _tiered_engine(tiny_dir: Path) -> LLMEngine:
    tiers = TierConfig(enabled=True, sink_tokens=4, hot_tokens=16, warm_tokens=256, group_size=16)
    return LLMEngine.load(
        tiny_dir, device="cpu", max_batch_size=2, max_seq_len=256, progress=False, kv=KVCacheSpec(tiers=tiers)
    )


def test_no_estimate_before_any_kv_is_held(tiny_dir: Path) -> None:
    engine = _tiered_engine(tiny_dir)
    assert QuantizationErrorEstimator(engine.runner.kv_cache.hot, 16).estimate() is None


def test_estimate_of_held_kv_is_small_but_not_zero_and_exported(tiny_dir: Path) -> None:
    engine = _tiered_engine(tiny_dir)
    engine.submit(list(range(5, 69)), SamplingParams(max_new_tokens=200, ignore_eos=True), lambda e: None)
    engine.step()  # prefill: 64 prompt tokens held in hot blocks
    estimate = QuantizationErrorEstimator(engine.runner.kv_cache.hot, 16).estimate()
    assert estimate is not None
    assert 0.0 < estimate.key_ratio < 0.2 and 0.0 < estimate.value_ratio < 0.2
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    text = generate_latest(registry).decode()
    assert 'thermocline_engine_kv_quantization_error_ratio{tensor="key"}' in text
    assert 'thermocline_engine_kv_occupancy_ratio{tier="hot"}' in text
    assert 'tier="cold"' not in text  # the kvstore reports its own occupancy


def test_kv_on_the_int4_grid_round_trips_exactly(tiny_dir: Path) -> None:
    engine = _tiered_engine(tiny_dir)
    hot = engine.runner.kv_cache.hot
    engine.submit(list(range(5, 69)), SamplingParams(max_new_tokens=200, ignore_eos=True), lambda e: None)
    engine.step()
    codes = torch.randint(0, 16, hot.keys.shape, generator=torch.Generator().manual_seed(0))
    hot.keys.copy_(codes.to(hot.keys.dtype))  # integers 0..15 with both ends present: exact in INT4
    hot.keys[..., 0, :, :] = 0
    hot.keys[..., 1, :, :] = 15
    estimate = QuantizationErrorEstimator(hot, 16).estimate()
    assert estimate is not None and estimate.key_ratio < 1e-6
