"""The reference attention path: gather each row's context dense, dequantize warm groups, then SDPA.

Slow by design (it writes a dense copy of every row's context in every layer), and the oracle the
fused Triton path is tested against. It also serves the CPU, where Triton has no compiled backend.
Shapes: B rows, S most new tokens in a row, T packed new tokens, L visible positions, H/KVH heads, D dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.engine.attention.backend import AttentionBackend
from services.engine.attention.metadata import AttentionMetadata
from services.engine.kv import kivi
from services.engine.kv.cache import KVCache


class DenseContext(NamedTuple):
    """Every row's visible context, dense, with the mask of what each query may attend."""

    keys: torch.Tensor  # [B, KVH, L, D] model dtype
    values: torch.Tensor  # [B, KVH, L, D]
    visible: torch.Tensor  # [B, 1, S, L] bool: causal and present (hot or warm)
    is_hot: torch.Tensor  # [B, 1, 1, L] bool: position read from the hot tier


class ReferenceBackend(AttentionBackend):
    """Gather + dequantize + `scaled_dot_product_attention`, on any device."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`[T, H, D]` -> `[T, H, D]` through a padded `[B, H, S, D]` batch."""
        context = dense_context(self.kv_cache, layer, metadata)
        rows, offsets = token_rows(metadata)
        padded = pad_queries(q, rows, offsets, metadata)  # [B, H, S, D]
        out = F.scaled_dot_product_attention(
            padded, context.keys, context.values, attn_mask=context.visible, enable_gqa=True
        )  # [B, H, S, D]
        return out.transpose(1, 2)[rows, offsets]  # [T, H, D]


def token_rows(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and offset within the row `[T]` of each packed token."""
    starts = metadata.paged.query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]  # [B]
    rows = torch.repeat_interleave(torch.arange(len(q_lens), device=starts.device), q_lens)  # [T]
    offsets = torch.arange(len(rows), device=starts.device) - starts[rows]
    return rows, offsets


def pad_queries(q: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, metadata: AttentionMetadata):
    """Packed `[T, H, D]` -> right-padded `[B, H, S, D]` (padding is zeros and its output unused)."""
    num_rows = metadata.paged.seq_lens.shape[0]
    padded = q.new_zeros(num_rows, metadata.max_query_len, *q.shape[1:])  # [B, S, H, D]
    padded[rows, offsets] = q
    return padded.transpose(1, 2)


def dense_context(kv_cache: KVCache, layer: int, metadata: AttentionMetadata) -> DenseContext:
    """Each row's positions `[0, max_seq_len)` read from its hot blocks or dequantized from warm."""
    paged = metadata.paged
    block_size = kv_cache.block_size
    device = paged.seq_lens.device
    positions = torch.arange(metadata.max_seq_len, device=device)  # [L]
    logical = positions // block_size
    hot_ids = paged.block_tables.long()[:, logical]  # [B, L]
    slots = hot_ids * block_size + positions % block_size
    num_kv_heads, head_dim = kv_cache.hot.keys.shape[-2:]
    keys = kv_cache.hot.keys[layer].view(-1, num_kv_heads, head_dim)[slots]  # [B, L, KVH, D]
    values = kv_cache.hot.values[layer].view(-1, num_kv_heads, head_dim)[slots]
    is_hot = hot_ids != 0
    present = is_hot
    if kv_cache.warm is not None:
        warm_blocks = paged.warm_block_tables.long()[:, logical]  # [B, L]
        is_warm = warm_blocks >= 0
        warm_keys, warm_values = _dequantize(
            kv_cache, layer, warm_blocks.clamp_min(0), positions % block_size
        )
        keys = torch.where(is_warm[..., None, None], warm_keys.to(keys.dtype), keys)
        values = torch.where(is_warm[..., None, None], warm_values.to(values.dtype), values)
        present = present | is_warm
    seq_lens = paged.seq_lens.long()
    present = present & (positions.view(1, -1) < seq_lens.view(-1, 1))  # [B, L]
    q_positions = _query_positions(metadata, seq_lens)  # [B, S]
    causal = positions.view(1, 1, -1) <= q_positions.unsqueeze(-1)  # [B, S, L]
    visible = (causal & present.unsqueeze(1)).unsqueeze(1)  # [B, 1, S, L]
    hot = (is_hot & present).view(len(seq_lens), 1, 1, -1)
    return DenseContext(keys.transpose(1, 2), values.transpose(1, 2), visible, hot)


def _query_positions(metadata: AttentionMetadata, seq_lens: torch.Tensor) -> torch.Tensor:
    """`[B, S]` absolute position of each row's new tokens; padding repeats the row's last one."""
    starts = metadata.paged.query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]  # [B]
    offsets = torch.arange(metadata.max_query_len, device=seq_lens.device).view(1, -1)
    offsets = torch.minimum(offsets, (q_lens - 1).clamp_min(0).view(-1, 1))
    return seq_lens.view(-1, 1) - q_lens.view(-1, 1) + offsets


def _dequantize(
    kv_cache: KVCache, layer: int, warm_blocks: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Warm keys/values at `(warm block, offset)` `[B, L]` -> 2 x `[B, L, KVH, D]` fp32."""
    warm = kv_cache.warm
    assert warm is not None
    views = warm.layer_views(layer, kv_cache.block_size)
    groups = warm_blocks // (warm.group_size // kv_cache.block_size)
    codes_shape = (-1, 1, *views.key_codes.shape[-2:])  # [B*L, 1, KVH, D/2]
    keys = kivi.dequantize_keys(
        views.key_codes[warm_blocks, offsets].reshape(codes_shape),
        views.key_scale[groups].flatten(0, 1),
        views.key_zero[groups].flatten(0, 1),
    )
    scale_shape = (-1, 1, *views.value_scale.shape[-2:])  # [B*L, 1, KVH, D/VG]
    values = kivi.dequantize_values(
        views.value_codes[warm_blocks, offsets].reshape(codes_shape),
        views.value_scale[warm_blocks, offsets].reshape(scale_shape),
        views.value_zero[warm_blocks, offsets].reshape(scale_shape),
    )
    shape = (*warm_blocks.shape, *keys.shape[-2:])
    return keys.view(shape), values.view(shape)
