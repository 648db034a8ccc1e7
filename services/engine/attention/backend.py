"""The attention-backend contract: what a model layer calls once its new keys and values are stored."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from services.engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Attention over the paged, tiered KV cache. Reads the cache; never writes it (`KVCache.store` does).

    `forward` must be capturable in a CUDA graph when `supports_graphs` is True: it may then read
    only the metadata's tensors, whose shapes stay fixed for a captured batch size.
    """

    supports_graphs: bool = False

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Packed queries `q` `[T, H, D]` (new `k`, `v` `[T, KVH, D]` already stored) -> `[T, H, D]`."""

    def num_segments(self, num_rows: int, max_seq_len: int) -> int:
        """How many programs split each row's context in a decode step (1: no split)."""
        return 1
