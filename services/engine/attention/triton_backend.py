"""The fused path: one Triton kernel reads hot pages and INT4 warm groups in place (see paged_kernels)."""

from __future__ import annotations

import torch
import triton

from services.engine.attention.backend import AttentionBackend
from services.engine.attention.metadata import AttentionMetadata
from services.engine.attention.paged_kernels import PagedLayer, Partials, head_dim_padded, paged_attention
from services.engine.kv.cache import KVCache

MAX_SEGMENTS = 32  # flash-decoding split cap (the merge kernel reads them all)
MIN_TOKENS_PER_SEGMENT = 256  # below this a split costs more in merging than it gains
# Enough programs to keep ~8 resident per SM of an H100/H200 (132 SMs): a decode program's loop is
# latency-bound (block-table load, then the tile's loads), so occupancy is what hides memory latency.
TARGET_PROGRAMS = 8 * 132


class TritonBackend(AttentionBackend):
    """Fused paged attention over both tiers; capturable in a CUDA graph (decode)."""

    supports_graphs = True

    def __init__(self, kv_cache: KVCache, num_heads: int, max_decode_rows: int) -> None:
        self.kv_cache = kv_cache
        self.layers = [_layer_view(kv_cache, layer) for layer in range(kv_cache.hot.keys.shape[0])]
        self.num_kv_heads = kv_cache.hot.keys.shape[-2]
        head_dim = kv_cache.hot.keys.shape[-1]
        device = kv_cache.hot.keys.device
        self.partials = Partials.empty(
            max_decode_rows, num_heads, MAX_SEGMENTS, head_dim_padded(head_dim), device
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`[T, H, D]` -> `[T, H, D]`."""
        out = torch.empty_like(q)
        partials = self.partials if metadata.num_segments > 1 else None
        return paged_attention(q, self.layers[layer], metadata.paged, out, metadata.num_segments, partials)

    def num_segments(self, num_rows: int, max_seq_len: int) -> int:
        """Enough programs to fill the GPU, but no segment under MIN_TOKENS_PER_SEGMENT positions."""
        if num_rows > self.partials.out.shape[0]:
            return 1
        by_occupancy = triton.cdiv(TARGET_PROGRAMS, num_rows * self.num_kv_heads)
        by_length = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SEGMENT)
        wanted = max(1, min(MAX_SEGMENTS, by_occupancy, by_length))
        return 1 << (wanted.bit_length() - 1)  # the merge kernel needs a power of two


def _layer_view(kv_cache: KVCache, layer: int) -> PagedLayer:
    warm = kv_cache.warm
    if warm is None:
        return PagedLayer(kv_cache.hot.keys[layer], kv_cache.hot.values[layer], None, 1)
    views = warm.layer_views(layer, kv_cache.block_size)
    return PagedLayer(
        kv_cache.hot.keys[layer], kv_cache.hot.values[layer], views, warm.group_size // kv_cache.block_size
    )
