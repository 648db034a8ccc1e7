"""Fused demotion: hot blocks quantized straight into their warm groups, one Triton launch a step.

The reference (`kivi.quantize_keys` / `quantize_values` behind a gather of the hot blocks) runs about
a dozen PyTorch kernels over float temporaries, so a step that demotes a long prompt's groups costs
tens of milliseconds (bench/results/decode_gpu_2026-12-03_median.md: the first decode step after a
32K prefill at batch 16 took 62 ms against a 16 ms median). Here each program reads one group of one
KV head of one layer from its hot blocks, quantizes it in registers and writes the codes, scales and
zeros in place: the hot bytes are read once and nothing else is written.

The arithmetic is kivi's, operation for operation, so the codes are the reference's bit for bit:
min and max rounded to fp16, scale = fp16(max(fp32(high - low) / 15, 1e-6)), code = round half to
even of (x - low) / scale, clamped to 0..15. Divisions are correctly rounded (`tl.div_rn`), as
PyTorch's are. On the CPU the same kernel runs under `TRITON_INTERPRET=1` in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LEVELS = tl.constexpr(15.0)  # kivi.LEVELS: INT4 codes 0..15
MIN_SCALE = tl.constexpr(1e-6)  # kivi's clamp on the scale


@triton.jit
def key_param_slot(channel, HEAD_DIM: tl.constexpr):
    """The stored slot of each channel's key scale and zero (kivi.key_param_channels, inverted)."""
    if HEAD_DIM % 8 != 0:
        return channel
    within = channel % 8
    return 2 * ((within % 4) * (HEAD_DIM // 8) + channel // 8) + within // 4


@triton.jit
def _round_half_even(x):
    """Round non-negative `x` to the nearest integer, ties to even (torch.round)."""
    floor = tl.floor(x)
    fraction = x - floor
    odd = (floor - 2.0 * tl.floor(floor * 0.5)) == 1.0
    up = (fraction > 0.5) | ((fraction == 0.5) & odd)
    return floor + up.to(tl.float32)


@triton.jit
def _quantize(x, low, high):
    """Codes (int32, 0..15), fp16 scale and fp16 zero of `x` fp32 against its `low`/`high` (broadcast)."""
    low16 = low.to(tl.float16)
    high16 = high.to(tl.float16)
    scale = tl.maximum(tl.div_rn(high16.to(tl.float32) - low16.to(tl.float32), LEVELS), MIN_SCALE)
    scale16 = scale.to(tl.float16)
    codes = _round_half_even(tl.div_rn(x - low16.to(tl.float32), scale16.to(tl.float32)))
    codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS).to(tl.int32)
    return codes, scale16, low16


@triton.jit
def _pack(codes, ROWS: tl.constexpr, DIM: tl.constexpr):
    """`[ROWS, DIM]` codes -> `[ROWS, DIM/2]` uint8, the low nibble the even channel (kivi.pack_int4)."""
    even, odd = tl.split(tl.reshape(codes, (ROWS, DIM // 2, 2)))
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def _demote_kernel(
    hot_keys_ptr,  # [L, N, BS, KVH, D] model dtype
    hot_values_ptr,
    block_ids_ptr,  # [n, G/BS] int32: the hot blocks of each demotion, in order
    group_ids_ptr,  # [n] int32: its warm group
    key_codes_ptr,  # [L, W, G, KVH, D/2] uint8
    key_scale_ptr,  # [L, W, KVH, D] fp16
    key_zero_ptr,
    value_codes_ptr,  # [L, W, G, KVH, D/2] uint8
    value_scale_ptr,  # [L, W, G, KVH, D/VG] fp16
    value_zero_ptr,
    stride_hot_l,
    stride_hot_b,
    stride_codes_l,
    stride_codes_w,
    stride_kscale_l,
    stride_kscale_w,
    stride_vscale_l,
    stride_vscale_w,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
):
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    copy = tl.program_id(0) // NUM_KV_HEADS
    layer = tl.program_id(1).to(tl.int64)
    BLOCKS: tl.constexpr = GROUP_SIZE // BLOCK_SIZE
    token = tl.arange(0, GROUP_SIZE)
    channel = tl.arange(0, HEAD_DIM)
    block = tl.load(block_ids_ptr + copy * BLOCKS + token // BLOCK_SIZE).to(tl.int64)  # [G]
    group = tl.load(group_ids_ptr + copy).to(tl.int64)
    # hot position (block, slot) of each token, channels contiguous
    slot = (token % BLOCK_SIZE) * NUM_KV_HEADS + kv_head
    rows = layer * stride_hot_l + block * stride_hot_b + slot * HEAD_DIM
    offsets = rows[:, None] + channel[None, :]  # [G, D]

    # keys: one scale and zero per channel, over the group's tokens
    keys = tl.load(hot_keys_ptr + offsets).to(tl.float32)
    codes, scale, zero = _quantize(keys, tl.min(keys, 0)[None, :], tl.max(keys, 0)[None, :])
    row = token * NUM_KV_HEADS + kv_head  # [G]: row of each token's codes within the group
    code_rows = layer * stride_codes_l + group * stride_codes_w + row * (HEAD_DIM // 2)
    code_offsets = code_rows[:, None] + tl.arange(0, HEAD_DIM // 2)[None, :]  # [G, D/2]
    tl.store(key_codes_ptr + code_offsets, _pack(codes, GROUP_SIZE, HEAD_DIM))
    key_params = layer * stride_kscale_l + group * stride_kscale_w + kv_head * HEAD_DIM
    key_params += key_param_slot(channel, HEAD_DIM)
    tl.store(key_scale_ptr + key_params, tl.reshape(scale, (HEAD_DIM,)))
    tl.store(key_zero_ptr + key_params, tl.reshape(zero, (HEAD_DIM,)))

    # values: one scale and zero per token, per VALUE_GROUP channels
    NUM_VALUE_GROUPS: tl.constexpr = HEAD_DIM // VALUE_GROUP
    values = tl.load(hot_values_ptr + offsets).to(tl.float32)
    values = tl.reshape(values, (GROUP_SIZE, NUM_VALUE_GROUPS, VALUE_GROUP))
    codes, scale, zero = _quantize(values, tl.min(values, 2)[:, :, None], tl.max(values, 2)[:, :, None])
    codes = tl.reshape(codes, (GROUP_SIZE, HEAD_DIM))
    tl.store(value_codes_ptr + code_offsets, _pack(codes, GROUP_SIZE, HEAD_DIM))
    value_group = tl.arange(0, NUM_VALUE_GROUPS)
    value_params = (
        layer * stride_vscale_l
        + group * stride_vscale_w
        + (row * NUM_VALUE_GROUPS)[:, None]
        + value_group[None, :]
    )
    tl.store(value_scale_ptr + value_params, tl.reshape(scale, (GROUP_SIZE, NUM_VALUE_GROUPS)))
    tl.store(value_zero_ptr + value_params, tl.reshape(zero, (GROUP_SIZE, NUM_VALUE_GROUPS)))


def supports(hot_keys: torch.Tensor, group_size: int) -> bool:
    """Whether the fused demotion takes this layout: power-of-two head dims and group sizes."""
    head_dim = hot_keys.shape[-1]
    return head_dim & (head_dim - 1) == 0 and group_size & (group_size - 1) == 0 and hot_keys.is_contiguous()


def demote(
    hot_keys: torch.Tensor,
    hot_values: torch.Tensor,
    block_ids: torch.Tensor,
    group_ids: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
) -> None:
    """Quantize the hot blocks `block_ids` `[n, G/BS]` (int32, on the device) into the warm groups
    `group_ids` `[n]`, every layer and KV head in one launch (the WarmTier and HotTier layouts)."""
    layers, _, block_size, num_kv_heads, head_dim = hot_keys.shape
    num_copies, blocks_per_group = block_ids.shape
    group_size = key_codes.shape[2]
    if blocks_per_group * block_size != group_size:
        raise ValueError(f"a group of {group_size} tokens is not {blocks_per_group} blocks of {block_size}")
    if not supports(hot_keys, group_size):
        raise ValueError(f"no fused demotion for head dim {head_dim}, group size {group_size}, strided pools")
    if num_copies == 0:
        return
    for t in (hot_keys, hot_values, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero):
        if not t.is_contiguous():
            raise ValueError("the fused demotion needs contiguous pools")
    value_group = head_dim // value_scale.shape[-1]
    _demote_kernel[(num_copies * num_kv_heads, layers)](
        hot_keys,
        hot_values,
        block_ids,
        group_ids,
        key_codes,
        key_scale,
        key_zero,
        value_codes,
        value_scale,
        value_zero,
        hot_keys.stride(0),
        hot_keys.stride(1),
        key_codes.stride(0),
        key_codes.stride(1),
        key_scale.stride(0),
        key_scale.stride(1),
        value_scale.stride(0),
        value_scale.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP_SIZE=group_size,
        VALUE_GROUP=value_group,
    )
