"""A prefill's warm prefix dequantized into pages of the hot layout, one Triton launch a layer.

A prefill step of at least PREFIX_PAGES_MIN_QUERY_TOKENS new tokens reads its rows' warm prefix as
pages (see TritonBackend): every layer of every such step first dequantizes that prefix. The
reference (`triton_backend.dequantize_prefix_reference`, kivi's functions behind gathers) runs
about ten PyTorch kernels a chunk of 256 blocks over fp32 temporaries: on the H200 it took about
3 ms of a 12.5 ms layer call for a 4,096-token chunk over a 28K prefix (bench/attention_kernel.py
--prefill 4096 --prefix-pages, against 9.3 ms with the same context hot). Here each program reads
one warm block of one KV head and writes its keys and values straight into their page: the codes
are read once, the pages written once, and nothing else moves.

The arithmetic is kivi's, operation for operation, in fp32 (`code * scale` rounded, then `+ zero`
rounded: the launch turns off fused multiply-adds), rounded once to the pages' dtype, so the pages
equal the reference's bit for bit. On the CPU the same kernel runs under `TRITON_INTERPRET=1` in the
tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kv.demote_kernel import key_param_slot


@triton.jit
def _unpack(codes, ROWS: tl.constexpr, DIM: tl.constexpr):
    """`[ROWS, DIM/2]` uint8 -> `[ROWS, DIM]` fp32 codes, low nibble the even channel (kivi.unpack_int4)."""
    codes = codes.to(tl.int32)
    return tl.reshape(tl.join(codes & 15, codes >> 4), (ROWS, DIM)).to(tl.float32)


@triton.jit
def _dequantize_prefix_kernel(
    key_codes_ptr,  # [WB, BS, KVH, D/2] uint8: one layer's warm tier seen as blocks (WarmLayer)
    key_scale_ptr,  # [W, KVH, D] fp16, in kivi.key_param_channels order
    key_zero_ptr,
    value_codes_ptr,  # [WB, BS, KVH, D/2] uint8
    value_scale_ptr,  # [WB, BS, KVH, D/VG] fp16
    value_zero_ptr,
    blocks_ptr,  # [S] int: the warm blocks, page s + 1 for block s
    keys_ptr,  # [S + 1, BS, KVH, D] the pages' dtype
    values_ptr,
    stride_codes_b,
    stride_kscale_g,
    stride_vscale_b,
    stride_page,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_GROUP: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
):
    page = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.load(blocks_ptr + page).to(tl.int64)
    group = block // BLOCKS_PER_GROUP
    token = tl.arange(0, BLOCK_SIZE)
    channel = tl.arange(0, HEAD_DIM)
    row = token * NUM_KV_HEADS + kv_head  # [BS]: each token's row of this head within the block
    byte = tl.arange(0, HEAD_DIM // 2)
    code_offsets = block * stride_codes_b + row[:, None] * (HEAD_DIM // 2) + byte[None, :]
    page_offsets = (page + 1).to(tl.int64) * stride_page + row[:, None] * HEAD_DIM + channel[None, :]

    key_params = group * stride_kscale_g + kv_head * HEAD_DIM + key_param_slot(channel, HEAD_DIM)
    key_scale = tl.load(key_scale_ptr + key_params).to(tl.float32)
    key_zero = tl.load(key_zero_ptr + key_params).to(tl.float32)
    keys = _unpack(tl.load(key_codes_ptr + code_offsets), BLOCK_SIZE, HEAD_DIM)
    keys = keys * key_scale[None, :] + key_zero[None, :]
    tl.store(keys_ptr + page_offsets, keys.to(keys_ptr.dtype.element_ty))

    NUM_VALUE_GROUPS: tl.constexpr = HEAD_DIM // VALUE_GROUP
    value_params = block * stride_vscale_b + row[:, None] * NUM_VALUE_GROUPS + channel[None, :] // VALUE_GROUP
    value_scale = tl.load(value_scale_ptr + value_params).to(tl.float32)
    value_zero = tl.load(value_zero_ptr + value_params).to(tl.float32)
    values = _unpack(tl.load(value_codes_ptr + code_offsets), BLOCK_SIZE, HEAD_DIM)
    values = values * value_scale + value_zero
    tl.store(values_ptr + page_offsets, values.to(values_ptr.dtype.element_ty))


def supports(key_codes: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the kernel takes this layout: power-of-two head dim and block size, contiguous tensors."""
    _, block_size, _, head_dim = keys.shape
    powers = all(n & (n - 1) == 0 for n in (head_dim, block_size))
    return powers and key_codes.is_contiguous() and keys.is_contiguous()


def dequantize_prefix(
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    blocks_per_group: int,
    blocks: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Warm blocks `blocks` `[S]` (integers, on the device) of one layer's warm tier (WarmLayer's tensors)
    into pages 1..S of `keys` and `values` `[S + 1, BS, KVH, D]`; page 0 is left as it is."""
    num_pages = blocks.shape[0]
    _, block_size, num_kv_heads, head_dim = keys.shape
    if not supports(key_codes, keys):
        raise ValueError(f"no fused prefix dequantization for head dim {head_dim}, block size {block_size}")
    if keys.shape[0] < num_pages + 1 or values.shape != keys.shape:
        raise ValueError(f"{num_pages} blocks need {num_pages + 1} pages: keys {tuple(keys.shape)}")
    if num_pages == 0:
        return
    for t in (key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, values):
        if not t.is_contiguous():
            raise ValueError("the fused prefix dequantization needs contiguous tensors")
    _dequantize_prefix_kernel[(num_pages, num_kv_heads)](
        key_codes,
        key_scale,
        key_zero,
        value_codes,
        value_scale,
        value_zero,
        blocks,
        keys,
        values,
        key_codes.stride(0),
        key_scale.stride(0),
        value_scale.stride(0),
        keys.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCKS_PER_GROUP=blocks_per_group,
        VALUE_GROUP=head_dim // value_scale.shape[-1],
        enable_fp_fusion=False,  # kivi's rounding: the product, then the sum
    )
