"""The attention probe: on sampled decode steps, the share of one layer's attention mass on hot tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.attention.metadata import AttentionMetadata
from services.engine.attention.reference import dense_context, pad_queries, token_rows
from services.engine.kv.cache import KVCache


@dataclass(frozen=True)
class AttentionProbe:
    """Where one layer writes the batch's mean share of attention mass on hot positions (decode steps)."""

    layer: int
    hot_mass: torch.Tensor  # [1] fp32, written on the device; read (one sync) only when sampled

    @classmethod
    def build(cls, layer: int, device: torch.device) -> AttentionProbe:
        """A probe that `record` fills at `layer`."""
        return cls(layer, torch.ones(1, device=device))

    def record(self, kv_cache: KVCache, q: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Reference softmax of packed `q` `[T, H, D]` over each row's context; keep the hot share."""
        context = dense_context(kv_cache, self.layer, metadata)
        rows, offsets = token_rows(metadata)
        padded = pad_queries(q, rows, offsets, metadata)  # [B, H, S, D]
        groups = padded.shape[1] // context.keys.shape[1]
        keys = context.keys.repeat_interleave(groups, dim=1)  # [B, H, L, D]
        scores = (padded.float() @ keys.float().transpose(-1, -2)) / q.shape[-1] ** 0.5  # [B, H, S, L]
        weights = scores.masked_fill(~context.visible, float("-inf")).softmax(-1)
        self.hot_mass.copy_((weights * context.is_hot).sum(-1).mean().view(1))
