"""The attention probe: on sampled decode steps, the share of one layer's attention mass on hot tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from services.engine.attention.metadata import AttentionMetadata
from services.engine.attention.reference import dense_context
from services.engine.kv.cache import KVCache


def probe_layer(num_layers: int) -> int:
    """The layer the probe measures: the last (the engine samples it, captured graphs keep its queries)."""
    return num_layers - 1


@dataclass(frozen=True)
class AttentionProbe:
    """Where one layer writes one row's share of attention mass on hot positions (decode steps).

    One row per sampled step (the runner rotates through the batch), so the probe's dense gather costs
    one context, not the batch's: at 32K tokens that is ~130 MB of fp32 keys instead of gigabytes.
    """

    layer: int
    row: int  # the batch row measured; taken modulo the step's row count
    hot_mass: torch.Tensor  # [1] fp32, written on the device; read (one sync) only when sampled

    @classmethod
    def build(cls, layer: int, device: torch.device, row: int = 0) -> AttentionProbe:
        """A probe that `record` fills at `layer` for batch row `row`."""
        return cls(layer, row, torch.ones(1, device=device))

    def record(self, kv_cache: KVCache, q: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Reference softmax of one decode row's query `[H, D]` over its context; keep the hot share."""
        paged = metadata.paged
        row = self.row % paged.seq_lens.shape[0]
        one_row = dataclasses.replace(
            metadata,
            positions=metadata.positions[row : row + 1],
            slot_mapping=metadata.slot_mapping[row : row + 1],
            paged=paged._replace(
                query_start_loc=paged.query_start_loc[:2] - paged.query_start_loc[0],
                seq_lens=paged.seq_lens[row : row + 1],
                block_tables=paged.block_tables[row : row + 1],
                warm_block_tables=paged.warm_block_tables[row : row + 1],
                max_query_len=1,
            ),
            probe=None,
        )
        context = dense_context(kv_cache, self.layer, one_row)  # keys [1, KVH, L, D]
        num_kv_heads = context.keys.shape[1]
        query = q[row].view(num_kv_heads, -1, q.shape[-1]).float()  # [KVH, G, D]: GQA without copies
        scores = (query @ context.keys[0].float().transpose(-1, -2)) / q.shape[-1] ** 0.5  # [KVH, G, L]
        weights = scores.masked_fill(~context.visible[0, :, :1], float("-inf")).softmax(-1)
        self.hot_mass.copy_((weights * context.is_hot[0, :, :1]).sum(-1).mean().view(1))
