"""The KV pool plan: what it allocates never exceeds its budget, and the sequences it promises fit.

The pools are built with the real HotTier/WarmTier classes on the meta device (shapes without memory),
so the bytes compared with the budget are those of the tensors the engine would allocate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine.kv.block_table import BlockTable
from services.engine.kv.cache import HotTier, KVCache, WarmTier
from services.engine.kv.capacity import KVBudgetTooSmall, footprint, plan_pools
from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.model.config import ModelConfig
from tests.engine.paged_helpers import CPU, ONE_HEAD

META = torch.device("meta")
GIB = 1 << 30
# One rank of the Llama-3.1-8B shape, and a small GQA model
LLAMA_8B = ModelConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
)  # fmt: skip
SMALL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=16, max_position_embeddings=4096,
)  # fmt: skip
TIERS = TierConfig(enabled=True, sink_tokens=4, hot_tokens=128, warm_tokens=1 << 20, group_size=32)


def _allocated_bytes(config: ModelConfig, spec: KVCacheSpec, hot_blocks: int, warm_groups: int) -> int:
    hot = HotTier(config, hot_blocks, spec.block_size, META, torch.bfloat16)
    tensors = [hot.keys, hot.values]
    if spec.tiers.enabled:
        warm = WarmTier(config, warm_groups, spec.tiers.group_size, META)
        tensors += [warm.key_codes, warm.key_scale, warm.key_zero, warm.value_codes, warm.value_scale]
        tensors += [warm.value_zero]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    ("config", "budget"),
    [(LLAMA_8B, 110 * GIB), (LLAMA_8B, 7 * GIB + 12345), (SMALL, 64 << 20), (SMALL, (3 << 20) + 17)],
)
@pytest.mark.parametrize("tiers", [TierConfig(), TIERS, dataclasses.replace(TIERS, warm_tokens=4096)])
@pytest.mark.parametrize("cap_at_need", [False, True])
def test_planned_pools_never_allocate_past_the_budget(
    config: ModelConfig, budget: int, tiers: TierConfig, cap_at_need: bool
) -> None:
    spec = KVCacheSpec(tiers=tiers)
    seq_len = 2048 if config is SMALL else 32768
    plan = plan_pools(config, spec, [], budget, 2, seq_len, 16, 4096, cap_at_need)
    allocated = _allocated_bytes(config, spec, plan.num_hot_blocks, plan.num_warm_groups)
    assert allocated == plan.kv_bytes  # the plan's arithmetic is the tiers' real layout
    assert allocated <= budget
    assert plan.concurrent_sequences >= 1
    if not cap_at_need:  # the whole budget is used, less than one hot block is left over
        assert budget - allocated < plan.hot_block_bytes + (plan.warm_group_bytes if tiers.enabled else 0)


def test_a_budget_too_small_for_one_sequence_is_refused_with_the_numbers() -> None:
    with pytest.raises(KVBudgetTooSmall, match=r"holds no sequence of 32768 tokens \(one needs"):
        plan_pools(LLAMA_8B, KVCacheSpec(tiers=TIERS), [], 1 * GIB, 2, 32768, 16, 4096, False)


def test_at_32k_on_the_8b_shape_the_tiers_hold_about_three_times_the_sequences() -> None:
    """The capacity line's arithmetic: the warm tier costs ~0.31x of BF16 per token, so the same budget
    holds about 3x as many 32K sequences with the tiers on."""
    off = plan_pools(LLAMA_8B, KVCacheSpec(), [], 110 * GIB, 2, 32768 + 128, 256, 4096, False)
    on = plan_pools(LLAMA_8B, KVCacheSpec(tiers=TIERS), [], 110 * GIB, 2, 32768 + 128, 256, 4096, False)
    assert 2.9 < on.concurrent_sequences / off.concurrent_sequences < 3.3


def test_the_promised_sequences_fit_and_the_footprint_is_tight() -> None:
    """Drive the real cache: `concurrent_sequences` sequences prefill then decode to max_seq_len in
    lockstep, and none ever lacks a hot block or a warm group; the footprint the plan assumed is at
    most one block and one group above the largest a sequence really held."""
    tiers = TierConfig(enabled=True, sink_tokens=3, hot_tokens=12, warm_tokens=1 << 20, group_size=8)
    spec = KVCacheSpec(block_size=4, tiers=tiers)
    seq_len, prefill = 160, 40
    plan = plan_pools(ONE_HEAD, spec, [], 12 * 1024, 4, seq_len, 64, prefill, cap_at_need=True)
    assert plan.hot_block_bytes == 2 * 2 * 4 * 1 * 2 * 4  # layers * (K+V) * BS * heads * dim * fp32
    cache = KVCache(
        HotTier(ONE_HEAD, plan.num_hot_blocks, 4, CPU, torch.float32),
        WarmTier(ONE_HEAD, plan.num_warm_groups, 8, CPU),
    )
    n = plan.concurrent_sequences
    assert n >= 3
    tables = [BlockTable(tiers) for _ in range(n)]
    peak_hot = peak_warm = 0
    for table in tables:  # prefills one at a time, each in one chunk
        assert cache.can_grow(table, prefill)
        cache.grow(table, prefill)
        cache.demote(table, prefill)
    for length in range(prefill, seq_len):  # decode: every sequence grows by one token per step
        for table in tables:
            assert cache.can_grow(table, length + 1), f"no hot block at length {length}"
            cache.grow(table, length + 1)
            peak_hot = max(peak_hot, cache.num_held_hot_blocks(table))
        cache.take_warm_copies()
        for table in tables:
            cache.demote(table, length + 1)
            assert table.num_dropped_blocks == 0, f"a warm group was missing at length {length}"
            peak_warm = max(peak_warm, len(table.warm_groups))
    planned = footprint(seq_len, 4, [tiers], True)
    assert peak_hot <= planned.hot_blocks <= peak_hot + 1
    assert peak_warm <= planned.warm_groups <= peak_warm + 1
