"""The attention probe measures one decode row's hot attention mass, and gets the same share as the whole
batch's dense computation gives for that row (GQA heads grouped, warm and hot context)."""

from __future__ import annotations

import torch

from services.engine.attention.metadata import AttentionMetadata, RowInput
from services.engine.attention.probe import AttentionProbe
from services.engine.attention.reference import dense_context
from services.engine.kv.block_table import BlockTable
from services.engine.kv.tiers import TierConfig
from services.engine.model.config import ModelConfig
from tests.engine.paged_helpers import CPU, make_cache

GQA = ModelConfig(
    vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4
)


def test_the_probe_of_each_row_equals_that_row_of_the_batch_computation() -> None:
    tiers = TierConfig(enabled=True, sink_tokens=2, hot_tokens=4, warm_tokens=64, group_size=4)
    cache = make_cache(GQA, num_blocks=32, block_size=2, tiers=tiers)
    generator = torch.Generator().manual_seed(0)
    tables = [BlockTable(tiers) for _ in range(3)]
    lengths = [23, 12, 16]
    for table, length in zip(tables, lengths, strict=True):
        cache.grow(table, length)
        metadata = AttentionMetadata.for_rows([RowInput(table, 0, length)], 2, 2, CPU)
        kv = torch.randn(2, length, 2, 4, generator=generator)
        cache.store(0, kv[0], kv[1], metadata.slot_mapping)
        cache.demote(table, length - 1)
    cache.copy_to_warm(cache.take_warm_copies())
    rows = [RowInput(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)]
    metadata = AttentionMetadata.for_rows(rows, 2, 2, CPU)
    q = torch.randn(3, 4, 4, generator=generator)  # [B, H, D]

    context = dense_context(cache, 0, metadata)
    keys = context.keys.repeat_interleave(2, dim=1)  # [B, H, L, D]
    scores = (q.unsqueeze(2) @ keys.transpose(-1, -2)) / 2.0  # [B, H, 1, L]
    weights = scores.masked_fill(~context.visible, float("-inf")).softmax(-1)
    expected = (weights * context.is_hot).sum(-1).mean(dim=(1, 2))  # [B]
    assert expected.min() > 0.0 and expected.max() < 1.0  # every row has hot and non-hot context

    for row in range(3):
        probe = AttentionProbe.build(0, CPU, row=row)
        probe.record(cache, q, metadata)
        torch.testing.assert_close(probe.hot_mass[0], expected[row])
