"""Helpers that drive the model over a paged KV cache directly, without the scheduler."""

from __future__ import annotations

import torch

from services.engine.attention.metadata import AttentionMetadata, RowInput
from services.engine.attention.reference import ReferenceBackend
from services.engine.kv.block_table import BlockTable
from services.engine.kv.cache import HotTier, KVCache, WarmTier
from services.engine.kv.tiers import TierConfig
from services.engine.model.config import ModelConfig
from services.engine.model.llama import LlamaModel

CPU = torch.device("cpu")
# 1 KV head of dim 2, 2 layers: the fake config of the cache and scheduler tests
ONE_HEAD = ModelConfig(
    vocab_size=4, hidden_size=2, intermediate_size=2, num_layers=2, num_heads=1, num_kv_heads=1, head_dim=2
)


def make_cache(
    config: ModelConfig,
    num_blocks: int = 64,
    block_size: int = 16,
    tiers: TierConfig | None = None,
    num_warm_groups: int = 64,
) -> KVCache:
    """A fp32 CPU cache; a warm tier of `num_warm_groups` groups when `tiers` are enabled."""
    hot = HotTier(config, num_blocks, block_size, CPU, torch.float32)
    warm = WarmTier(config, num_warm_groups, tiers.group_size, CPU) if tiers and tiers.enabled else None
    return KVCache(hot, warm)


def forward(
    model: LlamaModel, cache: KVCache, tables: list[BlockTable], ids: torch.Tensor, start: int
) -> torch.Tensor:
    """Run ids `[B, S]` at positions `[start, start+S)` for every row; returns hidden `[B, S, E]`."""
    width = ids.shape[1]
    for table in tables:
        cache.grow(table, start + width)
    rows = [RowInput(t, start, width) for t in tables]
    metadata = AttentionMetadata.for_rows(rows, cache.block_size, cache.blocks_per_group, CPU)
    with torch.inference_mode():
        hidden = model(ids.flatten(), cache, ReferenceBackend(cache), metadata)  # [B*S, E]
    return hidden.view(*ids.shape, -1)
