"""Fused paged attention in Triton over the hot (model dtype) and INT4 warm (KIVI) tiers.

One kernel serves decode, prefill and chunked prefill: each program takes one row's block of query
tokens for one KV head, with all the query heads that share that KV head stacked along M (GQA: each
KV tile is loaded once for the whole group). It walks the row's context in tiles of `TILE_N`
positions; each position is read from its hot block, or from its warm block's packed nibbles, which
are dequantized in registers. No dense copy of the context is ever written. Long contexts split
across `num_segments` programs (flash-decoding); a second kernel merges the partial softmaxes.

Cache layouts (one layer; the caller slices the layer off):
- hot keys/values `[N, BS, KVH, D]`, model dtype; block 0 is scratch and never read.
- warm codes `[WB, BS, KVH, D/2]` uint8 (a warm group of G tokens viewed as G/BS warm blocks; the low
  nibble is the even channel), key scale/zero `[W, KVH, D]` fp16 (per channel, one per group),
  value scale/zero `[WB, BS, KVH, D/VG]` fp16 (per token, per VG channels).
Metadata (int32): `query_start_loc [B+1]` into the packed queries, `seq_lens [B]` (context length
including the new tokens), `block_tables [B, MB]` (hot block per logical block, 0 = not hot),
`warm_block_tables [B, MB]` (warm block per logical block, -1 = not warm). A logical block in
neither is not attended (dropped by the window policy, or past the end).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


class WarmLayer(NamedTuple):
    """One layer of the INT4 warm tier, in the views the kernel reads."""

    key_codes: torch.Tensor  # [WB, BS, KVH, D/2] uint8
    key_scale: torch.Tensor  # [W, KVH, D] fp16
    key_zero: torch.Tensor  # [W, KVH, D] fp16
    value_codes: torch.Tensor  # [WB, BS, KVH, D/2] uint8
    value_scale: torch.Tensor  # [WB, BS, KVH, D/VG] fp16
    value_zero: torch.Tensor  # [WB, BS, KVH, D/VG] fp16


class PagedLayer(NamedTuple):
    """One layer's KV storage: the hot pages and, when the tiers are on, the warm tier."""

    hot_keys: torch.Tensor  # [N, BS, KVH, D]
    hot_values: torch.Tensor  # [N, BS, KVH, D]
    warm: WarmLayer | None
    blocks_per_group: int  # warm group size / block size (1 when there is no warm tier)


class Partials(NamedTuple):
    """Workspace for flash-decoding: each segment's unnormalized output, running max and sum."""

    out: torch.Tensor  # [T, H, S, D] fp32 (read as contiguous with the launch's S, so any S fits)
    max: torch.Tensor  # [T, H, S] fp32 (log2 domain)
    sum: torch.Tensor  # [T, H, S] fp32

    @classmethod
    def empty(cls, num_tokens: int, num_heads: int, num_segments: int, head_dim: int, device) -> Partials:
        """Uninitialized buffers for up to `num_tokens` query tokens (each launch writes all it reads)."""
        shape = (num_tokens, num_heads, num_segments)
        return cls(
            torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
        )


@triton.jit
def _dequantize_warm_tile(
    codes_ptr,
    scale_ptr,
    zero_ptr,
    scale_index,  # [TILE_N] int: scale row per position (key: group id; value: warm block id)
    codes_offsets,  # [TILE_N] int: element offset of each position's packed codes
    scale_offsets,  # [TILE_N] int: element offset of each position's scale row, past `scale_index`
    is_warm,  # [TILE_N] bool
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    CHANNELS_PER_SCALE: tl.constexpr,  # 1 for keys (per channel), VG for values (per channel group)
):
    """Packed nibbles and their fp16 scale/zero -> `[TILE_N, HEAD_DIM_PADDED]` fp32."""
    half = tl.arange(0, HEAD_DIM_PADDED // 2)
    packed = tl.load(
        codes_ptr + codes_offsets[:, None] + half[None, :],
        mask=is_warm[:, None] & (half[None, :] < HEAD_DIM // 2),
        other=0,
    )  # [TILE_N, D/2] uint8
    codes = tl.interleave(packed & 15, packed >> 4).to(tl.float32)  # [TILE_N, D]: even = low nibble
    channel = tl.arange(0, HEAD_DIM_PADDED)
    mask = is_warm[:, None] & (channel[None, :] < HEAD_DIM)
    offsets = scale_index[:, None] + scale_offsets[:, None] + channel[None, :] // CHANNELS_PER_SCALE
    scale = tl.load(scale_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return codes * scale + zero


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    part_out_ptr,  # [T, H, S, D] fp32 (NUM_SEGMENTS > 1)
    part_max_ptr,  # [T, H, S] fp32
    part_sum_ptr,  # [T, H, S] fp32
    q_ptr,  # [T, H, D]
    hot_keys_ptr,
    hot_values_ptr,  # [N, BS, KVH, D]
    key_codes_ptr,
    key_scale_ptr,
    key_zero_ptr,
    value_codes_ptr,
    value_scale_ptr,
    value_zero_ptr,
    block_tables_ptr,
    warm_tables_ptr,  # [B, MB] int32
    query_start_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_hot_b,
    stride_hot_t,
    stride_hot_h,
    stride_codes_b,
    stride_codes_t,
    stride_codes_h,
    stride_kscale_g,
    stride_kscale_h,
    stride_vscale_b,
    stride_vscale_t,
    stride_vscale_h,
    stride_table_b,
    sm_scale_log2,  # softmax scale times log2(e): the kernel works in base 2
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_GROUP: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    HAS_WARM: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    row = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SEGMENTS
    segment = tl.program_id(2) % NUM_SEGMENTS
    BLOCK_Q: tl.constexpr = BLOCK_M // QUERIES_PER_KV
    DOT_PRECISION: tl.constexpr = "ieee" if IEEE_DOT else "tf32"

    q_start = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    context_len = seq_len - q_len  # cached positions before the new tokens

    m_index = tl.arange(0, BLOCK_M)
    q_token = q_block * BLOCK_Q + m_index // QUERIES_PER_KV  # [M] index among the row's new tokens
    head = kv_head * QUERIES_PER_KV + m_index % QUERIES_PER_KV  # [M]
    is_query = (m_index < BLOCK_Q * QUERIES_PER_KV) & (q_token < q_len)
    q_position = context_len + q_token  # [M] absolute position of each query
    channel = tl.arange(0, HEAD_DIM_PADDED)
    has_channel = channel < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + q_token)[:, None] * stride_q_t + head[:, None] * stride_q_h + channel[None, :],
        mask=is_query[:, None] & has_channel[None, :],
        other=0.0,
    )  # [M, D]

    # keys this block of queries can see, split evenly (in whole tiles) across the segments
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    kv_end = tl.where(q_block * BLOCK_Q < q_len, kv_end, 0)  # q blocks past the row's end do nothing
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_begin = segment * tiles_per_segment
    tile_end = tl.minimum(tile_begin + tiles_per_segment, num_tiles)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    table_row = block_tables_ptr + row * stride_table_b
    warm_row = warm_tables_ptr + row * stride_table_b
    for tile in range(tile_begin, tile_end):
        position = tile * TILE_N + tl.arange(0, TILE_N)  # [N]
        in_context = position < kv_end
        logical_block = position // BLOCK_SIZE
        offset = position % BLOCK_SIZE
        hot_block = tl.load(table_row + logical_block, mask=in_context, other=0).to(tl.int64)
        is_hot = in_context & (hot_block != 0)
        hot_offsets = hot_block * stride_hot_b + offset * stride_hot_t + kv_head * stride_hot_h
        hot_mask = is_hot[:, None] & has_channel[None, :]
        hot_slot = hot_offsets[:, None] + channel[None, :]
        k = tl.load(hot_keys_ptr + hot_slot, mask=hot_mask, other=0.0)  # [N, D]
        v = tl.load(hot_values_ptr + hot_slot, mask=hot_mask, other=0.0)  # [N, D]
        is_present = is_hot
        if HAS_WARM:
            warm_block = tl.load(warm_row + logical_block, mask=in_context, other=-1)
            is_warm = in_context & (warm_block >= 0)
            warm_block = tl.where(is_warm, warm_block, 0).to(tl.int64)
            codes_offsets = warm_block * stride_codes_b + offset * stride_codes_t + kv_head * stride_codes_h
            warm_k = _dequantize_warm_tile(
                key_codes_ptr,
                key_scale_ptr,
                key_zero_ptr,
                (warm_block // BLOCKS_PER_GROUP) * stride_kscale_g,
                codes_offsets,
                tl.zeros_like(offset) + kv_head * stride_kscale_h,
                is_warm,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                1,
            )
            warm_v = _dequantize_warm_tile(
                value_codes_ptr,
                value_scale_ptr,
                value_zero_ptr,
                warm_block * stride_vscale_b,
                codes_offsets,
                offset * stride_vscale_t + kv_head * stride_vscale_h,
                is_warm,
                HEAD_DIM,
                HEAD_DIM_PADDED,
                VALUE_GROUP,
            )
            # rounded to the model dtype, as the reference path stores a dequantized key before SDPA
            k = tl.where(is_warm[:, None], warm_k.to(k.dtype), k)
            v = tl.where(is_warm[:, None], warm_v.to(v.dtype), v)
            is_present = is_present | is_warm

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [M, N]
        visible = is_present[None, :] & (position[None, :] <= q_position[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that have seen nothing yet
        rescale = tl.exp2(running_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max

    token = q_start + q_token
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + channel[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=is_query[:, None] & has_channel[None, :],
        )
    else:  # flash-decoding: this segment's share, merged by _merge_segments_kernel
        num_heads = tl.num_programs(2) // NUM_SEGMENTS * QUERIES_PER_KV
        part = (token * num_heads + head) * NUM_SEGMENTS + segment  # [M]
        tl.store(part_max_ptr + part, running_max, mask=is_query)
        tl.store(part_sum_ptr + part, running_sum, mask=is_query)
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM_PADDED + channel[None, :],
            acc,
            mask=is_query[:, None],
        )


@triton.jit
def _merge_segments_kernel(
    out_ptr,  # [T, H, D]
    part_out_ptr,  # [T, H, S, D_PADDED] fp32
    part_max_ptr,
    part_sum_ptr,  # [T, H, S] fp32
    stride_o_t,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    part = (token * NUM_HEADS + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)  # [S]
    seg_max = tl.load(part_max_ptr + part)
    seg_sum = tl.load(part_sum_ptr + part)
    top = tl.max(seg_max, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padding row: no segment saw a key
    weight = tl.exp2(seg_max - top)  # [S]: 0 for empty segments
    channel = tl.arange(0, HEAD_DIM_PADDED)
    seg_out = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PADDED + channel[None, :])  # [S, D]
    total = tl.sum(seg_sum * weight, 0)
    out = tl.sum(seg_out * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + channel,
        out.to(out_ptr.dtype.element_ty),
        mask=channel < HEAD_DIM,
    )


class PagedAttentionPlan(NamedTuple):
    """The int32 metadata of one launch (see the module docstring)."""

    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, MB]
    warm_block_tables: torch.Tensor  # [B, MB]
    max_query_len: int  # host int: sizes the grid


def head_dim_padded(head_dim: int) -> int:
    """The kernel's channel count: a power of two, at least 16 (the smallest `tl.dot`)."""
    return max(16, triton.next_power_of_2(head_dim))


def paged_attention(
    q: torch.Tensor,
    layer: PagedLayer,
    plan: PagedAttentionPlan,
    out: torch.Tensor,
    num_segments: int = 1,
    partials: Partials | None = None,
    tile_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Attention of packed queries `q` `[T, H, D]` over each row's paged context; writes `out` `[T, H, D]`.

    With `num_segments > 1` the context splits across programs (flash-decoding) and `partials` must
    hold at least `[T, H, num_segments, D_PADDED]`. `tile_n` (positions per loop step, a multiple of
    the block size) and `num_warps` override the launch shape; bench/attention_kernel.py compares them.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = layer.hot_keys.shape
    _check_inputs(q, layer, plan, out)
    queries_per_kv = num_heads // num_kv_heads
    is_decode = plan.max_query_len == 1
    # decode: one query token, so M is just the group's heads; prefill: 64 rows of (token, head)
    block_m = max(16 if is_decode else 64, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    padded = head_dim_padded(head_dim)
    warm = layer.warm
    if num_segments > 1:
        if num_segments & (num_segments - 1):
            raise ValueError(f"num_segments must be a power of two, got {num_segments}")
        needed = num_tokens * num_heads * num_segments
        if partials is None or partials.max.numel() < needed or partials.out.numel() < needed * padded:
            raise ValueError(f"flash-decoding over {num_segments} segments needs a larger Partials workspace")
    grid = (plan.seq_lens.shape[0], triton.cdiv(plan.max_query_len, block_q), num_kv_heads * num_segments)
    warm_args = _warm_args(warm, layer.hot_keys)
    _paged_attention_kernel[grid](
        out,
        *(partials if num_segments > 1 else (out, out, out)),
        q,
        layer.hot_keys,
        layer.hot_values,
        *warm_args,
        plan.block_tables,
        plan.warm_block_tables,
        plan.query_start_loc,
        plan.seq_lens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *layer.hot_keys.stride()[:3],
        *warm_args[0].stride()[:3],
        *warm_args[1].stride()[:2],
        *warm_args[4].stride()[:3],
        plan.block_tables.stride(0),
        LOG2_E / math.sqrt(head_dim),
        BLOCK_SIZE=block_size,
        BLOCKS_PER_GROUP=layer.blocks_per_group,
        VALUE_GROUP=head_dim // warm.value_scale.shape[-1] if warm is not None else 1,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=padded,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m,
        TILE_N=tile_n or _tile_n(block_size, warm is not None),
        NUM_SEGMENTS=num_segments,
        HAS_WARM=warm is not None,
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=num_warps,
    )
    if num_segments > 1:
        assert partials is not None
        _merge_segments_kernel[(num_tokens, num_heads)](
            out,
            *partials,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            NUM_SEGMENTS=num_segments,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=padded,
        )
    return out


def _tile_n(block_size: int, has_warm: bool) -> int:
    """Positions per loop step. With a warm tier, one block: the INT4 path holds the codes, scales and
    zeros of every position as fp32 tiles, and at 64 positions x 128 channels those spill registers
    (measured on the H200: a 32K-token decode ran ~0.5 us per position). Hot only: 64 positions."""
    if has_warm:
        return block_size
    return 64 if block_size <= 64 else block_size


def _warm_args(warm: WarmLayer | None, hot: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The warm tensors, or (with no warm tier) stand-ins of the right rank that are never read."""
    if warm is not None:
        return tuple(warm)
    codes = hot.view(torch.uint8)[:1]  # [1, ...] never dereferenced: HAS_WARM is False
    return (codes, hot[:1, 0], hot[:1, 0], codes, hot[:1], hot[:1])


def _check_inputs(q: torch.Tensor, layer: PagedLayer, plan: PagedAttentionPlan, out: torch.Tensor) -> None:
    """Shapes, dtypes and strides the kernel assumes; a mistake here would read the wrong memory."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, cache_dim = layer.hot_keys.shape[2:]
    if head_dim != cache_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q heads/dim {tuple(q.shape[1:])} do not fit the cache {tuple(layer.hot_keys.shape)}"
        )
    if out.shape != q.shape or out.dtype != q.dtype or q.dtype != layer.hot_keys.dtype:
        raise ValueError("q, out and the hot cache must share shape and dtype")
    for name, tensor in (
        ("q", q),
        ("out", out),
        ("hot keys", layer.hot_keys),
        ("hot values", layer.hot_values),
    ):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if layer.hot_keys.stride() != layer.hot_values.stride():
        raise ValueError("hot keys and values must share a layout")
    for name in ("query_start_loc", "seq_lens", "block_tables", "warm_block_tables"):
        if getattr(plan, name).dtype != torch.int32:
            raise ValueError(f"{name} must be int32")
    if plan.block_tables.stride() != plan.warm_block_tables.stride():
        raise ValueError("block_tables and warm_block_tables must share a layout")
    if layer.warm is not None and layer.warm.key_codes.stride() != layer.warm.value_codes.stride():
        raise ValueError("warm key and value codes must share a layout")
    if layer.warm is not None and head_dim % 2:
        raise ValueError(f"INT4 codes pack two channels per byte; head dim {head_dim} is odd")
