"""Fused Triton kernels for the decoder's small ops, each beside the torch reference it must match.

A decode step on a GPU is launch-bound outside the GEMMs and attention: as torch ops, one layer's
residual add + RMSNorm is ~8 kernels (twice per layer), RoPE on q and k plus the K/V scatter ~12, and
SiLU·mul 2. Here each is one kernel:
- `add_rmsnorm`: `stream = residual + x`, then `weight * rmsnorm(stream)`;
- `rotary_and_store`: rotate q and k of the merged QKV output in place and write k and v to their
  hot-cache slots;
- `silu_mul`: `silu(gate) * up` over the merged gate/up output.

Each kernel rounds to the model dtype exactly where the reference does, so in fp32 both agree to the
last bit except for the order of the norm's sum, and in bf16 they agree to within one rounding step.
The model calls the torch references on the CPU and the kernels on CUDA (`LlamaModel.fused_ops`);
tests run the kernels on the CPU under `TRITON_INTERPRET=1`.
Shapes: T tokens, E hidden, H/KVH heads, D head dim, I MLP width, P rotary positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.engine.model.rotary import apply_rotary

# --- residual add + RMSNorm ----------------------------------------------------------------------


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * rmsnorm(x)`, normalized in fp32 and cast back before the weight (as Llama does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight * rmsnorm(residual + x), residual + x)` as torch ops (the CPU path and the oracle)."""
    stream = residual + x
    return rmsnorm_reference(stream, weight, eps), stream


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, stream_ptr, hidden, eps, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    mask = col < hidden
    x = tl.load(x_ptr + token * hidden + col, mask=mask, other=0.0)
    residual = tl.load(residual_ptr + token * hidden + col, mask=mask, other=0.0)
    stream = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded, as the torch add
    tl.store(stream_ptr + token * hidden + col, stream, mask=mask)
    s = stream.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(s * s, 0) / hidden + eps)
    normed = (s * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + col, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rmsnorm_reference` in one kernel; `x` and `residual` are contiguous `[T, E]`."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x, dtype=torch.promote_types(weight.dtype, x.dtype))
    stream = torch.empty_like(x)
    if num_tokens:
        _add_rmsnorm_kernel[(num_tokens,)](
            x, residual, weight, out, stream, hidden, eps, BLOCK=triton.next_power_of_2(hidden)
        )
    return out, stream


# --- RoPE on q and k, and the K/V write to the hot cache -------------------------------------------


def rotary_and_store_reference(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate q and k of `qkv` `[T, (H + 2 KVH) * D]` (rotate-half layout, angles from the fp32 tables
    `[P, D]` at `positions`), write k and v to the `[N, BS, KVH, D]` caches at `slot_mapping`, and
    return q `[T, H, D]`, k, v `[T, KVH, D]`."""
    num_tokens = qkv.shape[0]
    head_dim = cos_table.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos = cos_table[positions].to(qkv.dtype).unsqueeze(-2)  # [T, 1, D]
    sin = sin_table[positions].to(qkv.dtype).unsqueeze(-2)
    q = apply_rotary(q.view(num_tokens, num_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(num_tokens, num_kv_heads, head_dim), cos, sin)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    key_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    value_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v
    return q, k, v


@triton.jit
def _rotary_and_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slots_ptr,
    key_cache_ptr,
    value_cache_ptr,
    stride_qkv_t,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..H-1: q heads; H..H+KVH-1: k heads; then v heads
    i = tl.arange(0, HALF_PADDED)
    mask = i < HEAD_DIM // 2
    base = qkv_ptr + token * stride_qkv_t + head * HEAD_DIM
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + HEAD_DIM // 2 + i, mask=mask, other=0.0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotate, rounding each product as the torch ops do
        dtype = x1.dtype
        position = tl.load(positions_ptr + token).to(tl.int64)
        c1 = tl.load(cos_ptr + position * HEAD_DIM + i, mask=mask).to(dtype).to(tl.float32)
        c2 = tl.load(cos_ptr + position * HEAD_DIM + HEAD_DIM // 2 + i, mask=mask).to(dtype).to(tl.float32)
        s1 = tl.load(sin_ptr + position * HEAD_DIM + i, mask=mask).to(dtype).to(tl.float32)
        s2 = tl.load(sin_ptr + position * HEAD_DIM + HEAD_DIM // 2 + i, mask=mask).to(dtype).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # out[:half] = x1*cos1 + (-x2)*sin1;  out[half:] = x2*cos2 + x1*sin2
        y1 = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
        y2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
        tl.store(base + i, y1, mask=mask)
        tl.store(base + HEAD_DIM // 2 + i, y2, mask=mask)
        if head >= NUM_HEADS:  # k: also to the cache
            dst = key_cache_ptr + slot * stride_cache_slot + (head - NUM_HEADS) * stride_cache_head
            tl.store(dst + i, y1, mask=mask)
            tl.store(dst + HEAD_DIM // 2 + i, y2, mask=mask)
    else:  # v: to the cache as it is
        dst = (
            value_cache_ptr + slot * stride_cache_slot + (head - NUM_HEADS - NUM_KV_HEADS) * stride_cache_head
        )
        tl.store(dst + i, x1, mask=mask)
        tl.store(dst + HEAD_DIM // 2 + i, x2, mask=mask)


def rotary_and_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rotary_and_store_reference` in one kernel, rotating q and k in place inside `qkv`."""
    num_tokens, width = qkv.shape
    head_dim = cos_table.shape[-1]
    if width != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1 or head_dim % 2:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not hold {num_heads}+2x{num_kv_heads} heads of {head_dim}"
        )
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1:
        raise ValueError("the key and value caches must share a layout, contiguous in the head dim")
    if num_tokens:
        _rotary_and_store_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
            qkv, cos_table, sin_table, positions, slot_mapping, key_cache, value_cache,
            qkv.stride(0), key_cache.stride(1), key_cache.stride(2),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HALF_PADDED=triton.next_power_of_2(head_dim // 2),
        )  # fmt: skip
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


# --- SiLU(gate) * up -----------------------------------------------------------------------------


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` `[T, 2I]` (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    gate = tl.load(gate_up_ptr + token * 2 * width + col, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + token * 2 * width + width + col, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + token * width + col, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_reference` in one kernel; `gate_up` is contiguous `[T, 2I]`."""
    num_tokens, double = gate_up.shape
    width = double // 2
    out = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if num_tokens:
        _silu_mul_kernel[(num_tokens, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out
