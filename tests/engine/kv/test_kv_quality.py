"""SmolLM2 with tiers on: KL to full attention over 512 tokens of the benchmark text stays bounded.

Same procedure as bench/kv_quality.py: the tiered run feeds chunks of 16 tokens and demotes after
each; the full-attention reference is one forward pass over all 512 tokens (the same math).
Measured on the 2-core EPYC dev box (2026-12-06) over 511 predicted tokens of the benchmark text
(Bierce's The Devil's Dictionary, see bench/kv_quality.py): mean KL(full || tiered), hot 128 + INT4
warm with group 32, is 0.00046 nats/token (p99 0.0050); with group 128, 0.00065; dropping the warm
tier instead (sink + hot window only) costs 0.0429. The bound, 0.0018, is 3.9x the measured value,
headroom for BLAS and thread-count rounding across CPUs and for a group-size change (2.8x the
group-128 figure), and still 24x below the window-only figure, which the second assertion checks,
so the test can fail. (Over 1,024 tokens the figures were 0.00070, 0.00099 and 0.0751, in twice
the CI time.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import kv_quality
from services.engine.kv.tiers import TierConfig
from services.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.real_model

NUM_TOKENS = 512
BOUND = 0.0018  # nats per token; measured 0.00046, see the module docstring


def _mean_kl(engine: LLMEngine, ids: list[int], tiers: TierConfig, reference: torch.Tensor) -> float:
    setting = kv_quality.Setting("t", tiers)
    row, _ = kv_quality.measure(engine.runner.model, ids, setting, reference, chunk=16)
    return row.mean_kl


def test_int4_warm_kl_over_512_tokens_stays_under_the_measured_bound(smollm_gguf: Path) -> None:
    engine = LLMEngine.load(
        smollm_gguf, device="cpu", max_batch_size=1, max_seq_len=NUM_TOKENS + 1, progress=False
    )
    ids = engine.tokenizer.encode(kv_quality.load_text()[: 8 * NUM_TOKENS])[:NUM_TOKENS]
    assert len(ids) == NUM_TOKENS
    model = engine.runner.model
    _, reference = kv_quality.measure(model, ids, kv_quality.Setting("full", None), None, chunk=NUM_TOKENS)
    tiered = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=1 << 20, group_size=32)
    assert _mean_kl(engine, ids, tiered, reference) < BOUND
    window_only = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=0, group_size=32)
    assert _mean_kl(engine, ids, window_only, reference) > BOUND
