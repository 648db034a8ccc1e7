"""Fused paged attention in Triton over the hot (model dtype) and INT4 warm (KIVI) tiers.

One kernel serves decode, prefill and chunked prefill: each program takes one row's block of query
tokens for one KV head, with all the query heads that share that KV head stacked along M (GQA: each
KV tile is loaded once for the whole group). It walks the row's context in tiles of `TILE_N`
positions; each position is read from its hot block, or from its warm block's packed nibbles, which
are dequantized in registers. No dense copy of the context is ever written. Long contexts split
across `num_segments` programs (flash-decoding); a second kernel merges the partial softmaxes.

The warm path is built for bytes in flight and few instructions per byte (bench/attention_kernel.py
measured each step on the H200): a tile's codes are read per block as contiguous slabs from one
table entry per block, as int32 words (a register per four code bytes); on a GPU the words are
unpacked in PTX straight into fp16 pairs in channel order (1.5 instructions per value, see
_WORDS_TO_F16_ASM); and the next tile's loads are issued before the current tile's math. The hot
positions of a tiered row (the sink and the recent window) are read in a pass of their own before
the warm loop, so the warm loop carries none of their registers. The program order puts the KV
heads of one (row, segment) side by side, so they read a position's neighbouring bytes together.

A warm decode launch with enough programs to fill the GPU runs one warp a program (MMA_LAYOUT, see
the comment above _key_channels): its warm tiles are built straight in the tensor cores' operand
registers, transposed (positions as rows, query heads as columns), and never pass through shared
memory. Four-warp decode and prefill keep the layout above.

Cache layouts (one layer; the caller slices the layer off):
- hot keys/values `[N, BS, KVH, D]`, model dtype; block 0 is scratch and never read.
- warm codes `[WB, BS, KVH, D/2]` uint8 (a warm group of G tokens viewed as G/BS warm blocks; the low
  nibble is the even channel), read by the kernel as `[WB, BS, KVH, D/8]` int32 words; key
  scale/zero `[W, KVH, D]` fp16 (per channel, one per group, in kivi.key_param_channels order);
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

from services.engine.kv.demote_kernel import key_param_slot

LOG2_E = 1.4426950408889634
LAZY_RESCALE_LOG2: tl.constexpr = tl.constexpr(8.0)


class WarmLayer(NamedTuple):
    """One layer of the INT4 warm tier, in the views the kernel reads."""

    key_codes: torch.Tensor  # [WB, BS, KVH, D/2] uint8
    key_scale: torch.Tensor  # [W, KVH, D] fp16, in kivi.key_param_channels order
    key_zero: torch.Tensor  # [W, KVH, D] fp16, in kivi.key_param_channels order
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
def _softmax_step(scores, running_max, running_sum):
    """One online-softmax update over a tile of masked scores (log2 domain).

    Returns (probabilities, factor for the accumulators, new running max, new running sum)."""
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that have seen nothing yet
    rescale = tl.exp2(running_max - safe_max)
    probs = tl.exp2(scores - safe_max[:, None])
    return probs, rescale, new_max, running_sum * rescale + tl.sum(probs, 1)


def _words_to_f16_asm() -> str:
    """PTX: two words of packed codes (eight nibbles each) -> the eight nibble planes as fp16 pairs, exact.

    Output $f holds nibble f of word 0 (low half) and of word 1 (high half); inputs $8 and $9 are the
    two words. Per byte k, prmt moves byte k of both words into the two halves of one register; the
    low nibbles are masked into the mantissa of 1024.0 and 1024.0 is subtracted (lop3, sub.f16x2),
    the high nibbles masked where they stand, giving 1024 + 16c, and brought down by one fma (times
    1/16, minus 64; exact, the values are small integers): 1.25 instructions per value."""
    lines = [
        ".reg .b32 t, bias, sixteenth, shift;",
        "mov.b32 bias, 0x64006400;",
        "mov.b32 sixteenth, 0x2C002C00;",
        "mov.b32 shift, 0xD400D400;",
    ]
    for byte in range(4):
        low, high = f"${2 * byte}", f"${2 * byte + 1}"
        selector = 0x4400 + 0x1111 * byte  # byte k of word 0 to the low half, of word 1 to the high
        lines += [
            f"prmt.b32 t, $8, $9, {selector:#06x};",
            f"lop3.b32 {low}, t, 0x000F000F, bias, 0xEA;",
            f"lop3.b32 {high}, t, 0x00F000F0, bias, 0xEA;",
            f"sub.f16x2 {low}, {low}, bias;",
            f"fma.rn.f16x2 {high}, {high}, sixteenth, shift;",
        ]
    return "{\n" + "\n".join(lines) + "\n}"


_WORDS_TO_F16_ASM = tl.constexpr(_words_to_f16_asm())


def _scaled_words_to_f16_asm() -> str:
    """_words_to_f16_asm with each value's scale and zero applied in the same pass: $10 holds the two
    words' scales (low half for word 0) and $11 their zeros, one fma per register."""
    body = _words_to_f16_asm().rstrip("}").rstrip()
    lines = [f"fma.rn.f16x2 ${i}, ${i}, $10, $11;" for i in range(8)]
    return body + "\n" + "\n".join(lines) + "\n}"


_SCALED_WORDS_TO_F16_ASM = tl.constexpr(_scaled_words_to_f16_asm())


@triton.jit
def _pack_halves(low, high):
    """Two fp16 tensors -> int32 registers holding (low, high) as an fp16 pair."""
    low_bits = low.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    high_bits = high.to(tl.int16, bitcast=True).to(tl.int32) << 16
    return low_bits | high_bits


@triton.jit
def _unpack_scaled_words(words, scale, zero):
    """Words of packed codes `[..., 2P]` and each word's fp16 scale and zero `[..., 2P]` -> the dequantized
    values `[..., 2P, 2, 2, 2]` in fp16 (GPU only), index (a, b, c) holding nibble 4a + 2b + c. The PTX
    takes neighbouring words along the last axis as a pair, so each register it returns holds one
    channel of the two.

    The pairs are made here, not by `inline_asm_elementwise(pack=2)`: packed by Triton, each call's
    two scales and two zeros were paired anew, 64 byte permutes a tile where 8 do (tools/kernel_sass.py)."""
    shape: tl.constexpr = words.shape
    paired: tl.constexpr = shape[:-1] + [shape[-1] // 2, 2]  # noqa: RUF005 (Triton parses no starred list)
    w0, w1 = tl.split(tl.reshape(words, paired))
    s0, s1 = tl.split(tl.reshape(scale, paired))
    z0, z1 = tl.split(tl.reshape(zero, paired))
    p = tl.inline_asm_elementwise(
        asm=_SCALED_WORDS_TO_F16_ASM,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
        args=[w0, w1, _pack_halves(s0, s1), _pack_halves(z0, z1)],
        dtype=(tl.int32,) * 8,
        is_pure=True,
        pack=1,
    )
    return _nibble_planes(
        _unpaired(p[0], shape), _unpaired(p[1], shape), _unpaired(p[2], shape), _unpaired(p[3], shape),
        _unpaired(p[4], shape), _unpaired(p[5], shape), _unpaired(p[6], shape), _unpaired(p[7], shape),
    )  # fmt: skip


@triton.jit
def _unpaired(pairs, shape: tl.constexpr):
    """int32 fp16 pairs `[..., P]` (as _pack_halves makes them) -> fp16 `shape` `[..., 2P]`, each pair's
    low half first."""
    return tl.reshape(tl.join(_half(pairs, False), _half(pairs, True)), shape)


@triton.jit
def _nibble_planes(p0, p1, p2, p3, p4, p5, p6, p7):
    """The eight nibble planes of words `[...]` (p_f: nibble f of each) -> `[..., 2, 2, 2]`, index (a, b, c)
    holding nibble 4a + 2b + c (tl.join stacks along a new last axis, so the last picks bit 0)."""
    even = tl.join(tl.join(p0, p4), tl.join(p2, p6))
    odd = tl.join(tl.join(p1, p5), tl.join(p3, p7))
    return tl.join(even, odd)


@triton.jit
def _unpack_scaled(words, scale, zero, dtype: tl.constexpr, ASM: tl.constexpr):
    """`[K, A, B, C]` words and each word's scale and zero -> the dequantized values `[K, A, B, C, 2, 2, 2]`
    (as _unpack_scaled_words); without `ASM` (the interpreter) the same values in portable form.

    This path (head dim 64, a word a position) lets Triton pair the words (`pack=2`): here that
    costs no extra permutes, and pairing them by hand took 28 more registers a thread (196 against
    168, tools/kernel_sass.py --head-dim 64), which leaves 10 warps an SM where 12 fit."""
    if ASM:
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            asm=_SCALED_WORDS_TO_F16_ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
            args=[words, scale, zero],
            dtype=(tl.float16,) * 8,
            is_pure=True,
            pack=2,
        )
        return _nibble_planes(p0, p1, p2, p3, p4, p5, p6, p7)
    codes = _unpack_words(words, dtype, False)
    return codes * scale[:, :, :, :, None, None, None] + zero[:, :, :, :, None, None, None]


@triton.jit
def _nibble(words, index: tl.constexpr, dtype: tl.constexpr):
    """Nibble `index` (0-7, from the low bits) of each int32 word, as an exact value in `dtype`."""
    return ((words >> (4 * index)) & 15).to(dtype)


@triton.jit
def _unpack_words(words, dtype: tl.constexpr, ASM: tl.constexpr):
    """int32 words of packed codes `[..., W]` -> the codes `[..., W, 2, 2, 2]` as exact values in `dtype`.

    Word w holds channels 8w..8w+7 as nibbles 0-7 (each byte's low nibble is its even channel), so
    reshaping the result to `[..., 8W]` gives the channels in order. Codes travel through the loop as
    words (a register per four bytes, where a loaded uint8 takes a register per byte), and are
    unpacked straight into fp16 pairs; with `ASM` (fp16 on a GPU) the unpacking is PTX, 1.25
    instructions per value (see _WORDS_TO_F16_ASM). The interpreter, and so CI, runs the portable
    form, which gives the same values."""
    if ASM:
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            asm=_WORDS_TO_F16_ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r",
            args=[words],
            dtype=(tl.float16,) * 8,
            is_pure=True,
            pack=2,
        )
    else:
        p0 = _nibble(words, 0, dtype)
        p1 = _nibble(words, 1, dtype)
        p2 = _nibble(words, 2, dtype)
        p3 = _nibble(words, 3, dtype)
        p4 = _nibble(words, 4, dtype)
        p5 = _nibble(words, 5, dtype)
        p6 = _nibble(words, 6, dtype)
        p7 = _nibble(words, 7, dtype)
    return _nibble_planes(p0, p1, p2, p3, p4, p5, p6, p7)  # [..., W, a, b, c] = nibble 4a + 2b + c


@triton.jit
def _load_codes(pointers, has_word, UNPADDED: tl.constexpr):
    """Packed code words at `pointers`, each row a whole warm block slab (a block that is not warm
    points at warm block 0: valid memory, and its scales load as 0, so its values dequantize to
    exactly 0). Unmasked when the head dim needs no padding: no per-word predicates in the loop."""
    if UNPADDED:
        return tl.load(pointers)
    return tl.load(pointers, mask=has_word, other=0)


@triton.jit
def _hot_update(
    q,  # [M, D]
    acc,  # [M, D] fp32
    running_max,
    running_sum,
    hot_keys_ptr,
    hot_values_ptr,
    hot_block,  # [N] int64: hot page of each position, 0 where this update skips it
    position,  # [N] absolute positions
    q_position,  # [M]
    kv_head,
    stride_hot_b,
    stride_hot_t,
    stride_hot_h,
    sm_scale_log2,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attend one tile of hot (model dtype) positions."""
    offsets = hot_block * stride_hot_b + (position % BLOCK_SIZE) * stride_hot_t + kv_head * stride_hot_h
    return _attend_rows(
        q, acc, running_max, running_sum, hot_keys_ptr + offsets, hot_values_ptr + offsets, hot_block != 0,
        position, q_position, sm_scale_log2, HEAD_DIM, HEAD_DIM_PADDED, CAUSAL, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def _attend_rows(
    q,  # [M, D]
    acc,  # [M, D] fp32
    running_max,
    running_sum,
    key_rows,  # [N] pointers: each position's key (model dtype, channels contiguous)
    value_rows,  # [N] pointers: each position's value
    attended,  # [N] bool: positions this update reads (the others are masked, their rows never read)
    position,  # [N] absolute positions
    q_position,  # [M]
    sm_scale_log2,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax update over a tile of positions read in the model dtype (hot or prefix pages)."""
    channel = tl.arange(0, HEAD_DIM_PADDED)
    mask = attended[:, None] & (channel < HEAD_DIM)[None, :]
    k = tl.load(key_rows[:, None] + channel[None, :], mask=mask, other=0.0)  # [N, D]
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N]
    scores = tl.where(_visible(attended, position, q_position, CAUSAL), scores * sm_scale_log2, float("-inf"))
    probs, rescale, running_max, running_sum = _softmax_step(scores, running_max, running_sum)
    v = tl.load(value_rows[:, None] + channel[None, :], mask=mask, other=0.0)  # [N, D]
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, running_max, running_sum


@triton.jit
def _prefix_update(
    q,  # [M, D]
    acc,  # [M, D] fp32
    running_max,
    running_sum,
    hot_keys_ptr,
    hot_values_ptr,
    hot_block,  # [N] int64: hot page of each position, 0 where it has none
    prefix_keys_ptr,
    prefix_values_ptr,
    prefix_block,  # [N] int64: prefix page of each position, 0 where it has none (wins over hot)
    position,  # [N] absolute positions
    q_position,  # [M]
    kv_head,
    stride_hot_b,
    stride_hot_t,
    stride_hot_h,
    stride_prefix_b,
    sm_scale_log2,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attend one tile whose positions each sit on a hot page or a prefix page (same layout within a
    page): one pass that picks each row's pointer, with no branch, so the loads pipeline as the hot
    path's do."""
    is_prefix = prefix_block != 0
    within = (position % BLOCK_SIZE) * stride_hot_t + kv_head * stride_hot_h
    hot_rows = hot_block * stride_hot_b + within
    prefix_rows = prefix_block * stride_prefix_b + within
    key_rows = tl.where(is_prefix, prefix_keys_ptr + prefix_rows, hot_keys_ptr + hot_rows)
    value_rows = tl.where(is_prefix, prefix_values_ptr + prefix_rows, hot_values_ptr + hot_rows)
    return _attend_rows(
        q, acc, running_max, running_sum, key_rows, value_rows, is_prefix | (hot_block != 0),
        position, q_position, sm_scale_log2, HEAD_DIM, HEAD_DIM_PADDED, CAUSAL, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def _hot_tile(
    q,  # [M, D]
    acc,  # [M, D] fp32
    running_max,
    running_sum,
    hot_keys_ptr,
    hot_values_ptr,
    prefix_keys_ptr,
    prefix_values_ptr,
    table_row,  # this row's hot block table
    prefix_row,  # this row's prefix-page table (HAS_PREFIX_PAGES)
    tile,
    kv_end,
    q_position,  # [M]
    kv_head,
    stride_hot_b,
    stride_hot_t,
    stride_hot_h,
    stride_prefix_b,
    sm_scale_log2,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_PREFIX_PAGES: tl.constexpr,
):
    """One tile of a context with no warm tier: hot pages, or (a prefill over a warm prefix that was
    dequantized once for all its query blocks) the prefix's pages where it has them."""
    position = tile * TILE_N + tl.arange(0, TILE_N)  # [N]
    in_context = position < kv_end
    logical_block = position // BLOCK_SIZE
    hot_block = tl.load(table_row + logical_block, mask=in_context, other=0).to(tl.int64)
    if HAS_PREFIX_PAGES:
        prefix_block = tl.load(prefix_row + logical_block, mask=in_context, other=0).to(tl.int64)
        return _prefix_update(
            q, acc, running_max, running_sum, hot_keys_ptr, hot_values_ptr, hot_block,
            prefix_keys_ptr, prefix_values_ptr, prefix_block, position, q_position, kv_head,
            stride_hot_b, stride_hot_t, stride_hot_h, stride_prefix_b, sm_scale_log2,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, CAUSAL, DOT_PRECISION,
        )  # fmt: skip
    return _hot_update(
        q, acc, running_max, running_sum, hot_keys_ptr, hot_values_ptr,
        hot_block, position, q_position, kv_head, stride_hot_b, stride_hot_t, stride_hot_h,
        sm_scale_log2, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, CAUSAL, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def _visible(attended, position, q_position, CAUSAL: tl.constexpr):
    """[M, N]: which of a tile's positions each query sees. A decode query comes after every cached
    position (`CAUSAL` off): then only the per-position mask remains, with no compare per element."""
    if CAUSAL:
        return attended[None, :] & (position[None, :] <= q_position[:, None])
    return attended[None, :] & (q_position >= 0)[:, None]


@triton.jit
def _warm_tile_table(warm_row, tile, tile_end, kv_end, BLOCK_SIZE: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """The warm block of each of a tile's logical blocks, -1 where not warm (or past the segment)."""
    blocks = tile * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)
    # `blocks < tile_end * TILE_BLOCKS` says `tile < tile_end` as a vector compare: a scalar compare
    # here comes out of Triton 3.9's interpreter as int32, which it then refuses as a load mask.
    in_range = (blocks * BLOCK_SIZE < kv_end) & (blocks < tile_end * TILE_BLOCKS)
    return tl.load(warm_row + blocks, mask=in_range, other=-1)


@triton.jit
def _warm_tile_loads(
    warm_block,  # [K] int: from _warm_tile_table
    kv_head,
    key_codes_ptr,
    key_scale_ptr,
    key_zero_ptr,
    value_codes_ptr,
    value_scale_ptr,
    value_zero_ptr,
    stride_codes_b,
    stride_codes_t,
    stride_codes_h,
    stride_kscale_g,
    stride_kscale_h,
    stride_vscale_b,
    stride_vscale_t,
    stride_vscale_h,
    dtype: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCKS_PER_GROUP: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    MMA_LAYOUT: tl.constexpr,
    KEY_ROWS: tl.constexpr,
):
    """Issue every load of one warm tile: the packed code words and their scales and zeros, not yet used.

    A block's codes are one contiguous `[BLOCK_SIZE, D/8]` slab of int32 words with a single
    key-scale row (its group's), so keys and values are read as `[K, BLOCK_SIZE, D/8]` from per-block
    base offsets, with no per-position gathers. A block that is not warm reads warm block 0 (valid
    memory) with zeroed scales and zeros, so it dequantizes to exactly 0 and needs no predicate.

    With MMA_LAYOUT the key scale and zero come as fp16 pairs in the key words' layout
    (_mma_key_params), the value words as
    `[K, PH, G, PL, W2]` (position PL * ph + pl of the block, word W2 * g + w2) and the value
    scale/zero as `[K, PH, G, PL, SW, SF]` (one per lane group when its words share a value group,
    else one per word, else per nibble); otherwise key scale/zero are `[K, 1, D]`, value words
    `[K, BS, W]` and value scale/zero `[K, BS, D/VG]`."""
    WORDS: tl.constexpr = HEAD_DIM_PADDED // 8
    NUM_GROUPS: tl.constexpr = HEAD_DIM_PADDED // VALUE_GROUP  # value groups covering the padded channels
    UNPADDED: tl.constexpr = HEAD_DIM == HEAD_DIM_PADDED
    is_warm_block = warm_block >= 0
    warm_block = tl.where(is_warm_block, warm_block, 0).to(tl.int64)
    block_base = warm_block * stride_codes_b + kv_head * stride_codes_h  # [K]
    token = _operand_rows(BLOCK_SIZE) if KEY_ROWS else tl.arange(0, BLOCK_SIZE)
    word = tl.arange(0, WORDS)
    slots = block_base[:, None, None] + (token * stride_codes_t)[None, :, None] + word[None, None, :]
    has_word = word[None, None, :] < HEAD_DIM // 8
    key_words = _load_codes(key_codes_ptr + slots, has_word, UNPADDED)  # [K, BS, W]
    group_base = (warm_block // BLOCKS_PER_GROUP) * stride_kscale_g + kv_head * stride_kscale_h
    scale_base = warm_block * stride_vscale_b + kv_head * stride_vscale_h
    if MMA_LAYOUT:
        PL: tl.constexpr = min(4, BLOCK_SIZE)
        PH: tl.constexpr = BLOCK_SIZE // PL
        G: tl.constexpr = min(8, WORDS)
        W2: tl.constexpr = WORDS // G
        SW: tl.constexpr = 1 if VALUE_GROUP >= 8 * W2 else W2
        SF: tl.constexpr = 1 if VALUE_GROUP >= 8 else 8
        position = (PL * tl.arange(0, PH))[None, :, None, None, None] + tl.arange(0, PL)[
            None, None, None, :, None
        ]
        if W2 == 2:
            # two word loads, each a [K, PH, G, PL] tensor whose neighbouring registers are
            # neighbouring positions: unpacked two words at a time (_unpack_words), a register then
            # holds one channel of two positions, as the value operand wants (one load of both words
            # would pair a position's two words instead, and every register would need regrouping)
            even_word = (2 * tl.arange(0, G))[None, None, :, None]
            even_position = tl.reshape(position, (1, PH, 1, PL))
            even_slots = block_base[:, None, None, None] + even_position * stride_codes_t + even_word
            value_words = tl.join(
                _load_codes(value_codes_ptr + even_slots, even_word < HEAD_DIM // 8, UNPADDED),
                _load_codes(value_codes_ptr + even_slots + 1, even_word + 1 < HEAD_DIM // 8, UNPADDED),
            )
        else:
            value_word = (W2 * tl.arange(0, G))[None, None, :, None, None] + tl.arange(0, W2)[
                None, None, None, None, :
            ]
            value_slots = block_base[:, None, None, None, None] + position * stride_codes_t + value_word
            value_words = _load_codes(value_codes_ptr + value_slots, value_word < HEAD_DIM // 8, UNPADDED)
        scale_word = (W2 * tl.arange(0, G))[None, None, :, None, None, None] + tl.arange(0, SW)[
            None, None, None, None, :, None
        ]
        group = (8 * scale_word + tl.arange(0, SF)[None, None, None, None, None, :]) // VALUE_GROUP
        scale_position = position[:, :, :, :, :, None] * stride_vscale_t
        scales = scale_base[:, None, None, None, None, None] + scale_position + group
        scale_mask = is_warm_block[:, None, None, None, None, None] & (group < HEAD_DIM // VALUE_GROUP)
    else:
        value_words = _load_codes(value_codes_ptr + slots, has_word, UNPADDED)
        channel = tl.arange(0, HEAD_DIM_PADDED)
        channels = group_base[:, None, None] + key_param_slot(channel, HEAD_DIM)[None, None, :]  # [K, 1, D]
        row_mask = is_warm_block[:, None, None] & (channel < HEAD_DIM)[None, None, :]
        group = tl.arange(0, NUM_GROUPS)
        scales = scale_base[:, None, None] + (token * stride_vscale_t)[None, :, None] + group[None, None, :]
        scale_mask = is_warm_block[:, None, None] & (group < HEAD_DIM // VALUE_GROUP)[None, None, :]
    if MMA_LAYOUT:
        key_scale, key_zero = _mma_key_params(
            group_base, key_scale_ptr, key_zero_ptr, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED
        )
    else:
        key_scale = tl.load(key_scale_ptr + channels, mask=row_mask, other=0.0).to(dtype)
        key_zero = tl.load(key_zero_ptr + channels, mask=row_mask, other=0.0).to(dtype)
    value_scale = tl.load(value_scale_ptr + scales, mask=scale_mask, other=0.0).to(dtype)
    value_zero = tl.load(value_zero_ptr + scales, mask=scale_mask, other=0.0).to(dtype)
    return key_words, key_scale, key_zero, value_words, value_scale, value_zero


@triton.jit
def _warm_update(
    q,  # [M, D] in the warm tier's arithmetic dtype
    acc,  # [M, D] fp32 (rescaled here)
    running_max,
    running_sum,
    key_words,  # [K, BS, D/8] int32 ... value_zero: one tile's _warm_tile_loads
    key_scale,
    key_zero,
    value_words,
    value_scale,
    value_zero,
    is_warm,  # [N] bool: per position, warm and inside the context
    position,  # [N]
    q_position,  # [M]
    sm_scale_log2,
    TILE_N: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ASM: tl.constexpr,
):
    """Attend one tile of INT4 warm positions, dequantized in registers."""
    dtype = q.dtype
    NUM_GROUPS: tl.constexpr = HEAD_DIM_PADDED // VALUE_GROUP
    k = tl.reshape(_unpack_words(key_words, dtype, ASM), (TILE_BLOCKS, BLOCK_SIZE, HEAD_DIM_PADDED))
    k = tl.reshape(k * key_scale + key_zero, (TILE_N, HEAD_DIM_PADDED))
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    scores = tl.where(_visible(is_warm, position, q_position, CAUSAL), scores * sm_scale_log2, float("-inf"))
    probs, rescale, running_max, running_sum = _softmax_step(scores, running_max, running_sum)
    v = tl.reshape(_unpack_words(value_words, dtype, ASM), (TILE_BLOCKS, BLOCK_SIZE, NUM_GROUPS, VALUE_GROUP))
    v = v * value_scale[:, :, :, None] + value_zero[:, :, :, None]
    v = tl.reshape(v, (TILE_N, HEAD_DIM_PADDED))
    acc = acc * rescale[:, None] + tl.dot(probs.to(dtype), v, input_precision=DOT_PRECISION)
    return acc, running_max, running_sum


def _scaled_word_to_f16_pairs_asm() -> str:
    """PTX: one word of packed codes -> four fp16 pairs, scaled and shifted. Output $j holds nibble j
    (low half) and nibble j + 4 (high half) of the word $12, times pair j's scales $(4 + j) plus its
    zeros $(8 + j). A nibble is masked into the mantissa of 1024.0 (lop3, two values); the pairs
    masked in place subtract 1024.0, those masked four bits up scale by 1/16 and subtract 64 in one
    fma (exact: the values are small integers); then one fma per pair applies its scale and zero."""
    return """{
.reg .b32 y, bias, sixteenth, shift;
mov.b32 bias, 0x64006400;
mov.b32 sixteenth, 0x2C002C00;
mov.b32 shift, 0xD400D400;
shr.b32 y, $12, 8;
lop3.b32 $0, $12, 0x000F000F, bias, 0xEA;
lop3.b32 $1, $12, 0x00F000F0, bias, 0xEA;
lop3.b32 $2, y, 0x000F000F, bias, 0xEA;
lop3.b32 $3, y, 0x00F000F0, bias, 0xEA;
sub.f16x2 $0, $0, bias;
fma.rn.f16x2 $1, $1, sixteenth, shift;
sub.f16x2 $2, $2, bias;
fma.rn.f16x2 $3, $3, sixteenth, shift;
fma.rn.f16x2 $0, $0, $4, $8;
fma.rn.f16x2 $1, $1, $5, $9;
fma.rn.f16x2 $2, $2, $6, $10;
fma.rn.f16x2 $3, $3, $7, $11;
}"""


_SCALED_WORD_TO_F16_PAIRS_ASM = tl.constexpr(_scaled_word_to_f16_pairs_asm())


@triton.jit
def _half(pairs, HIGH: tl.constexpr):
    """The low or high fp16 of int32 registers that each hold an fp16 pair."""
    bits = (pairs >> 16) if HIGH else pairs
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _pairs_as_nibbles(r0, r1, r2, r3, dtype: tl.constexpr):
    """Four `[...]` int32 tensors of fp16 pairs, pair j holding (nibble j, nibble j + 4) of a word ->
    `[..., 2, 2, 2]` in `dtype`, index (a, b, c) holding nibble 2a + b + 4c (as _nibbles_paired)."""
    low = tl.join(tl.join(_half(r0, False), _half(r2, False)), tl.join(_half(r1, False), _half(r3, False)))
    high = tl.join(tl.join(_half(r0, True), _half(r2, True)), tl.join(_half(r1, True), _half(r3, True)))
    return tl.join(low, high).to(dtype)


@triton.jit
def _unpack_scaled_words_paired(words, scale, zero, dtype: tl.constexpr, ASM: tl.constexpr):
    """int32 words of packed codes `[..., W]` -> the keys `[..., W, 2, 2, 2]` in `dtype`, index (a, b, c)
    holding nibble 2a + b + 4c times its scale plus its zero. `scale` and `zero` `[..., W, 2, 2]`
    int32 hold each word's four fp16 pairs (pair j = 2a + b at index (a, b), see _mma_key_params).

    The last axis pairs nibbles j and j + 4 of one word, which with `ASM` are the two halves of one
    register out of the PTX (_SCALED_WORD_TO_F16_PAIRS_ASM, one fma a pair for the scale and zero):
    a tensor-core operand that takes the pair as neighbouring channels reads that register as it is.
    (_unpack_words pairs two words instead.) Without `ASM` (the interpreter), the same values in
    portable form."""
    even, odd = tl.split(scale)
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    even, odd = tl.split(zero)
    z0, z2 = tl.split(even)
    z1, z3 = tl.split(odd)
    if ASM:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            asm=_SCALED_WORD_TO_F16_PAIRS_ASM,
            constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
            args=[s0, s1, s2, s3, z0, z1, z2, z3, words],
            dtype=(tl.int32,) * 4,
            is_pure=True,
            pack=1,
        )
        return _pairs_as_nibbles(r0, r1, r2, r3, dtype)
    codes = _nibbles_paired(words, dtype)
    return codes * _pairs_as_nibbles(s0, s1, s2, s3, dtype) + _pairs_as_nibbles(z0, z1, z2, z3, dtype)


@triton.jit
def _nibbles_paired(words, dtype: tl.constexpr):
    """int32 words of packed codes `[..., W]` -> the codes `[..., W, 2, 2, 2]` as exact values in `dtype`,
    index (a, b, c) holding nibble 2a + b + 4c (the PTX's pairing, in portable form)."""
    low = tl.join(tl.join(_nibble(words, 0, dtype), _nibble(words, 2, dtype)),
                  tl.join(_nibble(words, 1, dtype), _nibble(words, 3, dtype)))  # fmt: skip
    high = tl.join(tl.join(_nibble(words, 4, dtype), _nibble(words, 6, dtype)),
                   tl.join(_nibble(words, 5, dtype), _nibble(words, 7, dtype)))  # fmt: skip
    return tl.join(low, high)


# The operand layout of a one-warp warm decode (MMA_LAYOUT). The tensor cores take a key tile
# `[positions, channels]` with lane l holding positions l/4 and l/4 + 8 and, of each 16 channels, four
# chosen by l % 4; the values `[channels, positions]` with lane l holding channels l/4 + 8i and four
# positions chosen by l % 4. A dot product does not care in which order it meets the channels, as long
# as both sides agree, so the kernel numbers the channels its own way: the keys' so that lane l % 4
# loads a quarter of each position's code words (one 16-byte load), the values' so that lane l / 4
# loads an eighth of them; the query is read in the keys' order, and the accumulator is kept in the
# values' order and put back at the end. Then every warm operand goes from its load to the tensor
# cores in registers, with no trip through shared memory (tools/kernel_sass.py counts them).


@triton.jit
def _key_channels(HEAD_DIM_PADDED: tl.constexpr):
    """The stored channel of each key channel in MMA_LAYOUT order: [A, F1, T, F0, F2] for word
    A_PER_LANE * T + A and nibble 4 * F2 + 2 * F1 + F0."""
    d = tl.arange(0, HEAD_DIM_PADDED)
    A_PER_LANE: tl.constexpr = HEAD_DIM_PADDED // 32
    word = A_PER_LANE * ((d // 4) % 4) + d // 32
    return 8 * word + 4 * (d % 2) + 2 * ((d // 16) % 2) + (d // 2) % 2


@triton.jit
def _to_value_order(x, M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
    """`[M, D]` in stored channel order -> MMA_LAYOUT value order [W2, F, G] (channel 8 (W2 g + w2) + f)."""
    G: tl.constexpr = min(8, HEAD_DIM_PADDED // 8)
    x = tl.reshape(x, (M, G, HEAD_DIM_PADDED // 8 // G, 8))
    return tl.reshape(tl.permute(x, (0, 2, 3, 1)), (M, HEAD_DIM_PADDED))


@triton.jit
def _from_value_order(x, M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
    """The inverse of _to_value_order."""
    G: tl.constexpr = min(8, HEAD_DIM_PADDED // 8)
    x = tl.reshape(x, (M, HEAD_DIM_PADDED // 8 // G, 8, G))
    return tl.reshape(tl.permute(x, (0, 3, 1, 2)), (M, HEAD_DIM_PADDED))


@triton.jit
def _mma_key_params(
    param_base,  # [K] int64: each block's group's key parameters, in fp16 elements
    key_scale_ptr,
    key_zero_ptr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    """A tile's key scales and zeros as fp16 pairs in the code words' own layout: two `[K, BS, W, 2, 2]`
    int32, index (a, b) of word w holding the pair for channels 8w + j and 8w + j + 4 with j = 2a + b.

    The stored order (kivi.key_param_channels) puts pair j of every word in one contiguous run, so
    each of the eight loads has the shape and the contiguity of the code words' `[K, BS, W]` load
    (constant along the positions), and Triton gives it their register layout: the parameters meet
    the codes with no shuffle. (Loaded as `[K, D]` in channel order, bringing them into the tile's
    layout took 89 permutes and shared-memory moves a tile.) A block that is not warm reads group
    0's parameters, which are finite; its scores are masked."""
    STORED_WORDS: tl.constexpr = HEAD_DIM // 8
    word = tl.arange(0, HEAD_DIM_PADDED // 8)
    same_for_each_position = (0 * tl.arange(0, BLOCK_SIZE))[None, :, None]
    slots = (param_base // 2)[:, None, None] + word[None, None, :] + same_for_each_position
    has_word = word[None, None, :] < STORED_WORDS
    scales = key_scale_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + slots
    zeros = key_zero_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + slots
    return (
        _pair_runs(scales, has_word, STORED_WORDS, HEAD_DIM == HEAD_DIM_PADDED),
        _pair_runs(zeros, has_word, STORED_WORDS, HEAD_DIM == HEAD_DIM_PADDED),
    )


@triton.jit
def _pair_runs(pointers, has_word, STORED_WORDS: tl.constexpr, UNPADDED: tl.constexpr):
    """The four runs of pairs (j = 0..3, each STORED_WORDS long) at `pointers` `[K, BS, W]` ->
    `[K, BS, W, 2, 2]`, pair j at index (j // 2, j % 2)."""
    run0 = _load_codes(pointers, has_word, UNPADDED)
    run1 = _load_codes(pointers + STORED_WORDS, has_word, UNPADDED)
    run2 = _load_codes(pointers + 2 * STORED_WORDS, has_word, UNPADDED)
    run3 = _load_codes(pointers + 3 * STORED_WORDS, has_word, UNPADDED)
    return tl.join(tl.join(run0, run2), tl.join(run1, run3))


@triton.jit
def _mma_warm_update(
    q_t,  # [D, M] the query in key order, transposed, in the warm tier's arithmetic dtype
    acc_t,  # [D, M] fp32 in value order, transposed (rescaled here)
    running_max,
    sums_t,  # [N, M] fp32: the running sum, spread over the tile's rows (summed once, after the loop)
    key_words,  # ... value_zero: one tile's _warm_tile_loads
    key_scale,
    key_zero,
    value_words,
    value_scale,
    value_zero,
    is_warm,  # [N] bool
    sm_scale_log2,
    TILE_N: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    VALUE_GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ASM: tl.constexpr,
    PROBS_IN_REGISTERS: tl.constexpr,
    BRANCH_FREE_RESCALE: tl.constexpr,
):
    """_warm_update for one decode query per row, in MMA_LAYOUT and transposed: the tile's positions are
    the rows of the tensor-core tile and the query heads its columns, so a group of four heads pads to
    eight columns (not sixteen rows) and the accumulator takes half the registers. The key scale and
    zero are applied as the codes unpack (_unpack_scaled_words_paired)."""
    dtype = q_t.dtype
    A_PER_LANE: tl.constexpr = HEAD_DIM_PADDED // 32
    PL: tl.constexpr = min(4, BLOCK_SIZE)
    G: tl.constexpr = min(8, HEAD_DIM_PADDED // 8)
    W2: tl.constexpr = HEAD_DIM_PADDED // 8 // G
    SW: tl.constexpr = 1 if VALUE_GROUP >= 8 * W2 else W2
    SF: tl.constexpr = 1 if VALUE_GROUP >= 8 else 8
    k = _unpack_scaled_words_paired(key_words, key_scale, key_zero, dtype, ASM)  # [K, BS, W, F1, F0, F2]
    k = tl.reshape(k, (TILE_BLOCKS, BLOCK_SIZE, 4, A_PER_LANE, 2, 2, 2))  # [K, BS, T, A, F1, F0, F2]
    k = tl.reshape(tl.permute(k, (0, 1, 3, 4, 2, 5, 6)), (TILE_N, HEAD_DIM_PADDED))
    scores = tl.dot(k, q_t, input_precision=DOT_PRECISION)  # [N, M]
    scores = tl.where(is_warm[:, None], scores * sm_scale_log2, float("-inf"))
    PH: tl.constexpr = BLOCK_SIZE // PL
    if W2 == 2:
        # the two word loads apart (see _warm_tile_loads), each unpacked two positions at a time
        low, high = tl.split(value_words)
        if ASM and SW == 1 and SF == 1:
            # one scale and zero a position: the PTX applies them to the register pairs it makes,
            # which are then the value operand's as they stand (regrouping them for a separate
            # multiply took 60 byte permutes a tile)
            scale = tl.reshape(value_scale, (TILE_BLOCKS, PH, G, PL))
            zero = tl.reshape(value_zero, (TILE_BLOCKS, PH, G, PL))
            v = tl.join(_unpack_scaled_words(low, scale, zero), _unpack_scaled_words(high, scale, zero))
        else:
            v = tl.join(_unpack_words(low, dtype, ASM), _unpack_words(high, dtype, ASM))
        v = tl.permute(tl.reshape(v, (TILE_BLOCKS, PH, G, PL, 8, W2)), (0, 1, 2, 3, 5, 4))  # [..., W2, 8]
    elif SW == 1 and SF == 1:
        # one word a position (head dim 64), one scale a position: scaled as the words unpack (in the
        # PTX on a GPU), pairing neighbouring positions as the value operand wants (applied after
        # the unpacking, the scales took 30 byte permutes and shuffles a tile more)
        words = tl.reshape(value_words, (TILE_BLOCKS, PH, G, PL))
        scale = tl.reshape(value_scale, (TILE_BLOCKS, PH, G, PL))
        zero = tl.reshape(value_zero, (TILE_BLOCKS, PH, G, PL))
        v = tl.reshape(_unpack_scaled(words, scale, zero, dtype, ASM), (TILE_BLOCKS, PH, G, PL, W2, 8))
    else:
        v = tl.reshape(_unpack_words(value_words, dtype, ASM), (TILE_BLOCKS, PH, G, PL, W2, 8))
    if not (SW == 1 and SF == 1 and (ASM or W2 == 1)):
        v = v * value_scale + value_zero  # [K, PH, G, PL, SW, SF] broadcasts: SW is 1 or W2, SF 1 or 8
    v_t = tl.reshape(tl.permute(v, (4, 5, 2, 0, 1, 3)), (HEAD_DIM_PADDED, TILE_N))  # [D, N]
    # Lazy rescaling: the running max moves only when a head's tile max passes it by more than
    # LAZY_RESCALE_LOG2 (the probabilities then stay below 2^LAZY_RESCALE_LOG2, well inside fp16), so
    # most tiles skip the accumulator's rescale (a multiply per accumulator register). The branch
    # is uniform: the program is one warp. The test is one reduction over the whole tile (the heads'
    # own maxima are needed only on the rare tile that moves them): the reduction's shuffles are a
    # serial chain that every tile waits on before its probabilities. (A head that has seen nothing
    # yet, running max -inf, reads +inf or, where the tile is masked too, NaN, which the max skips.)
    if BRANCH_FREE_RESCALE:
        # Each head's max moves on its own, and the accumulator is always multiplied (by exactly 1 for a
        # head whose max stays): 32 multiplies a tile for no branch and no reduction across heads,
        # so the unrolled tiles' work can interleave (bench/attention_kernel.py's seventh field).
        tile_max = tl.max(scores, 0)
        moves = tile_max - running_max > LAZY_RESCALE_LOG2
        new_max = tl.where(moves, tl.maximum(running_max, tile_max), running_max)
        rescale = tl.exp2(running_max - tl.where(new_max == float("-inf"), 0.0, new_max))
        acc_t = acc_t * rescale[None, :]
        sums_t = sums_t * rescale[None, :]
        running_max = new_max
    elif tl.max(scores - running_max[None, :]) > LAZY_RESCALE_LOG2:
        tile_max = tl.max(scores, 0)
        new_max = tl.maximum(running_max, tile_max)
        rescale = tl.exp2(running_max - tl.where(new_max == float("-inf"), 0.0, new_max))
        acc_t = acc_t * rescale[None, :]
        sums_t = sums_t * rescale[None, :]
        running_max = new_max
    safe_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    probs = tl.exp2(scores - safe_max[None, :])
    # the sum over the tile's positions waits for the end of the loop: here an add per register,
    # where a sum across the warp's lanes would take a chain of shuffles every tile
    sums_t = sums_t + probs
    probs = probs.to(dtype)
    if PROBS_IN_REGISTERS:
        probs = _probs_as_operand(probs, TILE_N, ASM)
    acc_t = tl.dot(v_t, probs, acc_t, input_precision=DOT_PRECISION)
    return acc_t, running_max, sums_t


@triton.jit
def _operand_rows(N: tl.constexpr):
    """The tile position that each row of a one-warp key tile holds when the probabilities reach the
    second product in registers (_probs_as_operand): within each 16 rows, row r holds position
    (r % 2) + 2 ((r // 8) % 2) + 4 ((r // 2) % 4). Softmax does not care in which order the rows
    come, and this order is the one in which the registers that movmatrix leaves are the operand's."""
    r = tl.arange(0, N)
    return (r // 16) * 16 + r % 2 + 2 * ((r // 8) % 2) + 4 * ((r // 2) % 4)


@triton.jit
def _probs_as_operand(probs, TILE_N: tl.constexpr, ASM: tl.constexpr):
    """The probabilities `[N, 8]` (rows in _operand_rows order, in the accumulator layout of the scores'
    product) -> `[N, 8]` in position order, in the layout of the second product's right-hand operand.

    In the accumulator, lane l holds rows l/4 (+ 8) of heads 2(l%4) and 2(l%4) + 1; the operand
    (Triton gives 16-bit operands four neighbouring positions a lane) wants positions 4(l%4) + 0..3
    of head l/4. `movmatrix.trans` transposes each 8x8 block of 16-bit values across the warp, one
    register a lane, which puts every value in the right lane; the key rows' order (_operand_rows)
    puts it in the right register. What is left is relabelling (reshape and permute, no data moved),
    after which Triton finds the tensor already in the operand's layout. Otherwise the conversion
    goes through shared memory: a store, a barrier and a load with bank conflicts, on the path to the
    product. Without `ASM` (the interpreter), the same transposes as plain tensor ops."""
    if ASM:
        moved = tl.inline_asm_elementwise(
            asm="movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
            constraints="=r,r",
            args=[probs],
            dtype=probs.dtype,
            is_pure=True,
            pack=2,
        )
    else:
        moved = tl.reshape(tl.permute(tl.reshape(probs, (TILE_N // 8, 8, 8)), (0, 2, 1)), (TILE_N, 8))
    # lane l, register (j, h) holds moved[l/4 + 8h, 2(l%4) + j] = row 2(l%4) + j + 8h of head l/4,
    # which is position j + 2h + 4(l%4): exactly the operand's
    moved = tl.reshape(moved, (TILE_N // 16, 2, 8, 4, 2))  # [U, H, N, L, J]
    return tl.reshape(tl.permute(moved, (0, 3, 1, 4, 2)), (TILE_N, 8))  # [U, L, H, J, N]


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    part_out_ptr,  # [T, H, S, D] fp32 (NUM_SEGMENTS > 1)
    part_max_ptr,  # [T, H, S] fp32
    part_sum_ptr,  # [T, H, S] fp32
    q_ptr,  # [T, H, D]
    hot_keys_ptr,
    hot_values_ptr,  # [N, BS, KVH, D]
    prefix_keys_ptr,
    prefix_values_ptr,  # [S, BS, KVH, D]: a prefill's warm prefix, dequantized
    prefix_tables_ptr,  # [B, MB] int32: prefix page per logical block, 0 = none
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
    # The caches' strides are compile-time constants: each tile's loads then address their block's
    # base plus immediate offsets, where runtime strides cost a 64-bit address sum per load (56 of a
    # one-warp warm tile's 543 instructions, tools/kernel_sass.py). An engine's pools keep one layout
    # for its life, so a model compiles each launch variant once.
    stride_hot_b: tl.constexpr,
    stride_hot_t: tl.constexpr,
    stride_hot_h: tl.constexpr,
    stride_codes_b: tl.constexpr,
    stride_codes_t: tl.constexpr,
    stride_codes_h: tl.constexpr,
    stride_kscale_g: tl.constexpr,
    stride_kscale_h: tl.constexpr,
    stride_vscale_b: tl.constexpr,
    stride_vscale_t: tl.constexpr,
    stride_vscale_h: tl.constexpr,
    stride_table_b,
    stride_prefix_b,
    sm_scale_log2,  # softmax scale times log2(e): the kernel works in base 2
    NUM_KV_HEADS: tl.constexpr,
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
    HAS_PREFIX_PAGES: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    DECODE: tl.constexpr,  # one query token per row
    ASM_DEQUANT: tl.constexpr,  # unpack the warm codes in PTX (fp16 on a GPU; see _unpack_words)
    MMA_LAYOUT: tl.constexpr,  # one-warp decode: warm tiles built in the tensor cores' layout (see above)
    WARM_UNROLL: tl.constexpr,  # warm loop iterations unrolled together (see SINGLE_WARP_UNROLL)
    BRANCH_FREE_RESCALE: tl.constexpr,  # one-warp decode: per-head rescale, no branch (_mma_warm_update)
    SPLIT_CAUSAL: tl.constexpr,  # prefill without a warm tier: the causal compare on diagonal tiles only
):
    # the KV heads of one (row, segment) are neighbours in launch order: they run together and read
    # neighbouring bytes (a position's heads are adjacent in every cache layout)
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    segment = tl.program_id(0) // NUM_KV_HEADS
    q_block = tl.program_id(1)
    row = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // QUERIES_PER_KV
    TILE_BLOCKS: tl.constexpr = TILE_N // BLOCK_SIZE
    CAUSAL: tl.constexpr = BLOCK_Q > 1 or not DECODE  # a decode query sees its whole context
    DOT_PRECISION: tl.constexpr = "ieee" if IEEE_DOT else "tf32"
    SCAN_TILES: tl.constexpr = 16  # tiles per table read of the hot pass

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
    q_rows = q_ptr + (q_start + q_token)[:, None] * stride_q_t + head[:, None] * stride_q_h
    q = tl.load(q_rows + channel[None, :], mask=is_query[:, None] & has_channel[None, :], other=0.0)  # [M, D]

    # keys this block of queries can see, split evenly (in whole tiles) across the segments
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    kv_end = tl.where(q_block * BLOCK_Q < q_len, kv_end, 0)  # q blocks past the row's end do nothing
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    # the last segments can start past the row's last tile (2,057 tiles in 128 segments of 17 leave
    # seven empty): such a segment's range is empty, begin == end, for the warm pass's bounds too
    tile_end = tl.minimum((segment + 1) * tiles_per_segment, num_tiles)
    tile_begin = tl.minimum(segment * tiles_per_segment, tile_end)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    table_row = block_tables_ptr + row * stride_table_b
    warm_row = warm_tables_ptr + row * stride_table_b
    prefix_row = prefix_tables_ptr + row * stride_table_b
    if HAS_WARM:
        # Two passes over the segment's tiles: first the hot pass, which attends only the tiles with
        # hot positions (the sink and the recent window, a few tiles of a long row), then the warm
        # pass, straight-line. Apart, the warm loop carries none of the hot path's registers (the
        # model-dtype query and tiles): on sm_90 the 4-warp program needs 206 registers a thread
        # against 238, and 168 with no spills under WARM_DECODE_MAX_REGISTERS (tools/kernel_sass.py).
        #
        # The scan reads the tables SCAN_TILES tiles at a time and visits only the tiles with hot
        # positions: a tile-by-tile scan waits on a table load per tile, which at 32K cost a long
        # row's programs more than the hot tiles themselves. A block in both tiers is read as warm.
        #
        # The scan also finds the segment's first and last tiles with warm positions, and the warm
        # pass runs between them: the recent window's tiles, which end a long row's last segment,
        # would otherwise go through the warm loop as well, masked, and make that segment the
        # slowest of the launch.
        warm_begin = tile_end
        warm_end = tile_begin
        for chunk in range(tile_begin, tile_end, SCAN_TILES):
            tiles = chunk + tl.arange(0, SCAN_TILES)
            blocks = tiles[:, None] * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)[None, :]  # [S, K]
            scan_mask = (tiles < tile_end)[:, None] & (blocks * BLOCK_SIZE < kv_end)
            hot_entry = tl.load(table_row + blocks, mask=scan_mask, other=0)
            warm_entry = tl.load(warm_row + blocks, mask=scan_mask, other=-1)
            has_warm = tl.max(warm_entry, 1) >= 0  # [S]
            warm_begin = tl.minimum(warm_begin, tl.min(tl.where(has_warm, tiles, tile_end), 0))
            warm_end = tl.maximum(warm_end, tl.max(tl.where(has_warm, tiles + 1, tile_begin), 0))
            has_hot = tl.max(tl.where(warm_entry >= 0, 0, hot_entry), 1) > 0  # [S]
            tile = tl.min(tl.where(has_hot, tiles, tile_end), 0)
            while tile < tile_end:
                position = tile * TILE_N + tl.arange(0, TILE_N)
                in_context = position < kv_end
                logical_block = position // BLOCK_SIZE
                hot_block = tl.load(table_row + logical_block, mask=in_context, other=0).to(tl.int64)
                is_warm = tl.load(warm_row + logical_block, mask=in_context, other=-1) >= 0
                acc, running_max, running_sum = _hot_update(
                    q, acc, running_max, running_sum, hot_keys_ptr, hot_values_ptr,
                    tl.where(is_warm, 0, hot_block), position, q_position, kv_head,
                    stride_hot_b, stride_hot_t, stride_hot_h, sm_scale_log2,
                    BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, CAUSAL, DOT_PRECISION,
                )  # fmt: skip
                tile = tl.min(tl.where(has_hot & (tiles > tile), tiles, tile_end), 0)
        # The warm tier is dequantized and multiplied in fp16 for a 16-bit model (see _unpack_words), so
        # the query meets it in fp16: exact for a bf16 query inside fp16's range, which is clamped to it.
        WARM_DTYPE: tl.constexpr = tl.float32 if IEEE_DOT else tl.float16
        # a one-warp tile whose probabilities reach the second product in registers (_probs_as_operand):
        # whole 16-row groups of one block each, and eight heads' columns
        PROBS_IN_REGISTERS: tl.constexpr = MMA_LAYOUT and BLOCK_SIZE % 16 == 0 and BLOCK_M == 8
        if MMA_LAYOUT:
            key_channel = _key_channels(HEAD_DIM_PADDED)
            key_mask = is_query[:, None] & (key_channel < HEAD_DIM)[None, :]
            q_keyed = tl.load(q_rows + key_channel[None, :], mask=key_mask, other=0.0)
            q_warm = tl.trans(tl.clamp(q_keyed.to(tl.float32), -65504.0, 65504.0).to(WARM_DTYPE))  # [D, M]
            acc = tl.trans(_to_value_order(acc, BLOCK_M, HEAD_DIM_PADDED))  # [D, M]
            # [N, M]: the hot pass's sums in the first row (see _mma_warm_update's sums_t)
            running_sum = tl.where(tl.arange(0, TILE_N)[:, None] == 0, running_sum[None, :], 0.0)
        else:
            q_warm = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(WARM_DTYPE)
        # Software pipeline by hand: while a tile's math runs, the next tile's codes are already in
        # flight (their table entries one tile further ahead), so the loop never waits on a load
        # it has just issued.
        table = _warm_tile_table(warm_row, warm_begin, warm_end, kv_end, BLOCK_SIZE, TILE_BLOCKS)
        key_words, key_scale, key_zero, value_words, value_scale, value_zero = _warm_tile_loads(
            table, kv_head, key_codes_ptr, key_scale_ptr, key_zero_ptr,
            value_codes_ptr, value_scale_ptr, value_zero_ptr,
            stride_codes_b, stride_codes_t, stride_codes_h, stride_kscale_g, stride_kscale_h,
            stride_vscale_b, stride_vscale_t, stride_vscale_h,
            WARM_DTYPE, BLOCK_SIZE, BLOCKS_PER_GROUP, VALUE_GROUP, HEAD_DIM, HEAD_DIM_PADDED, MMA_LAYOUT,
            PROBS_IN_REGISTERS,
        )  # fmt: skip
        next_table = _warm_tile_table(warm_row, warm_begin + 1, warm_end, kv_end, BLOCK_SIZE, TILE_BLOCKS)
        for tile in tl.range(warm_begin, warm_end, loop_unroll_factor=WARM_UNROLL):
            # [N]: the position of each of the tile's rows (in _operand_rows order where they come so)
            position = tile * TILE_N + (_operand_rows(TILE_N) if PROBS_IN_REGISTERS else tl.arange(0, TILE_N))
            in_context = position < kv_end
            tile_key_words, tile_key_scale, tile_key_zero = key_words, key_scale, key_zero
            tile_value_words, tile_value_scale, tile_value_zero = value_words, value_scale, value_zero
            tile_table, table = table, next_table
            key_words, key_scale, key_zero, value_words, value_scale, value_zero = _warm_tile_loads(
                table, kv_head, key_codes_ptr, key_scale_ptr, key_zero_ptr,
                value_codes_ptr, value_scale_ptr, value_zero_ptr,
                stride_codes_b, stride_codes_t, stride_codes_h, stride_kscale_g, stride_kscale_h,
                stride_vscale_b, stride_vscale_t, stride_vscale_h,
                WARM_DTYPE, BLOCK_SIZE, BLOCKS_PER_GROUP, VALUE_GROUP, HEAD_DIM, HEAD_DIM_PADDED, MMA_LAYOUT,
                PROBS_IN_REGISTERS,
            )  # fmt: skip
            next_table = _warm_tile_table(warm_row, tile + 2, warm_end, kv_end, BLOCK_SIZE, TILE_BLOCKS)
            # the tile's table came in a tile ahead of its codes: no load here for the mask to wait on
            if TILE_BLOCKS == 1:
                is_warm = in_context & (tl.max(tile_table, 0) >= 0)
            else:
                block_is_warm = tl.broadcast_to((tile_table >= 0)[:, None], (TILE_BLOCKS, BLOCK_SIZE))
                is_warm = in_context & tl.reshape(block_is_warm, (TILE_N,))
            if MMA_LAYOUT:
                acc, running_max, running_sum = _mma_warm_update(
                    q_warm, acc, running_max, running_sum,
                    tile_key_words, tile_key_scale, tile_key_zero,
                    tile_value_words, tile_value_scale, tile_value_zero,
                    is_warm, sm_scale_log2, TILE_N, TILE_BLOCKS, BLOCK_SIZE,
                    HEAD_DIM, HEAD_DIM_PADDED, VALUE_GROUP, DOT_PRECISION, ASM_DEQUANT, PROBS_IN_REGISTERS,
                    BRANCH_FREE_RESCALE,
                )  # fmt: skip
            else:
                acc, running_max, running_sum = _warm_update(
                    q_warm, acc, running_max, running_sum,
                    tile_key_words, tile_key_scale, tile_key_zero,
                    tile_value_words, tile_value_scale, tile_value_zero,
                    is_warm, position, q_position, sm_scale_log2, TILE_N, TILE_BLOCKS, BLOCK_SIZE,
                    HEAD_DIM_PADDED, VALUE_GROUP, CAUSAL, DOT_PRECISION, ASM_DEQUANT,
                )  # fmt: skip
        if MMA_LAYOUT:
            acc = _from_value_order(tl.trans(acc), BLOCK_M, HEAD_DIM_PADDED)
            running_sum = tl.sum(running_sum, 0)
    else:
        # A prefill's tiles that end before the block's first query are seen whole by every query:
        # with SPLIT_CAUSAL they run without the causal compare, and only the tiles on the diagonal
        # pay it.
        full_end = tile_begin
        if CAUSAL and SPLIT_CAUSAL:
            first_query = context_len + q_block * BLOCK_Q
            full_end = tl.maximum(tl.minimum(tile_end, (first_query + 1) // TILE_N), tile_begin)
        for tile in range(tile_begin, full_end):
            acc, running_max, running_sum = _hot_tile(
                q, acc, running_max, running_sum, hot_keys_ptr, hot_values_ptr, prefix_keys_ptr,
                prefix_values_ptr, table_row, prefix_row, tile, kv_end, q_position, kv_head,
                stride_hot_b, stride_hot_t, stride_hot_h, stride_prefix_b, sm_scale_log2,
                BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, TILE_N, False, DOT_PRECISION, HAS_PREFIX_PAGES,
            )  # fmt: skip
        for tile in range(full_end, tile_end):
            acc, running_max, running_sum = _hot_tile(
                q, acc, running_max, running_sum, hot_keys_ptr, hot_values_ptr, prefix_keys_ptr,
                prefix_values_ptr, table_row, prefix_row, tile, kv_end, q_position, kv_head,
                stride_hot_b, stride_hot_t, stride_hot_h, stride_prefix_b, sm_scale_log2,
                BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PADDED, TILE_N, CAUSAL, DOT_PRECISION, HAS_PREFIX_PAGES,
            )  # fmt: skip

    token = q_start + q_token
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + channel[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=is_query[:, None] & has_channel[None, :],
        )
    else:  # flash-decoding: this segment's share, merged by _merge_segments_kernel
        num_heads = NUM_KV_HEADS * QUERIES_PER_KV
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
    first = (token * NUM_HEADS + head) * NUM_SEGMENTS
    top = tl.max(tl.load(part_max_ptr + first + tl.arange(0, NUM_SEGMENTS)), 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padding row: no segment saw a key
    # the segments' outputs in chunks of at most 32 `[C, D]` tiles (a one-row decode splits 128 ways)
    CHUNK: tl.constexpr = min(32, NUM_SEGMENTS)
    channel = tl.arange(0, HEAD_DIM_PADDED)
    acc = tl.zeros([HEAD_DIM_PADDED], dtype=tl.float32)
    total = 0.0
    for chunk in range(0, NUM_SEGMENTS, CHUNK):
        part = first + chunk + tl.arange(0, CHUNK)  # [C]
        weight = tl.exp2(tl.load(part_max_ptr + part) - top)  # [C]: 0 for empty segments
        total += tl.sum(tl.load(part_sum_ptr + part) * weight, 0)
        seg_out = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PADDED + channel[None, :])  # [C, D]
        acc += tl.sum(seg_out * weight[:, None], 0)
    out = acc / tl.where(total == 0.0, 1.0, total)
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


class WarmPrefixPages(NamedTuple):
    """A prefill step's warm prefix, dequantized into pages of the hot layout (one layer at a time).

    Page 0 is never read; `tables` maps each row's logical blocks to a page, 0 where the block is
    not among them (read from the hot tier as usual)."""

    keys: torch.Tensor  # [S, BS, KVH, D], model dtype
    values: torch.Tensor  # [S, BS, KVH, D]
    tables: torch.Tensor  # [B, MB] int32, laid out as the plan's block tables


# The register cap per thread of a 4-warp warm decode launch. Uncapped, ptxas gives it 206
# registers, so two fit on an SM; at 168 three fit, with no spills in the warm loop
# (tools/kernel_sass.py). On the H200 (bench/results/decode_gpu_2026-12-02b.md) that took a 32K,
# batch-16 layer call from 837 to 764 us and 1K batch 256 from 499 to 447; at 128 the loop spills.
WARM_DECODE_MAX_REGISTERS = 168
# A warm decode launch with at least this many programs (about 8 per SM of an H200) runs one warp a
# program (see _warm_decode_launch).
SINGLE_WARP_MIN_PROGRAMS = 1024
# Pipeline stages of that one-warp launch (see _warm_decode_launch).
SINGLE_WARP_STAGES = 1
# Warm-loop iterations the one-warp launch unrolls together. Its loop carries the next tile's loads
# in registers (the software pipeline); unrolled, consecutive iterations take turns with two sets of
# registers, and the moves from one set into the other at every back edge go away. (A four-warp
# launch, capped at WARM_DECODE_MAX_REGISTERS, spills when unrolled: it stays at 1.)
SINGLE_WARP_UNROLL = 2
# The fewest positions in a tile on a GPU: the probabilities-times-values product reduces over the
# tile's positions, and a tensor-core reduction is at least 16 long (`tl.dot` refuses less).
MIN_GPU_TILE = 16


def head_dim_padded(head_dim: int) -> int:
    """The kernel's channel count: a power of two, at least 32 (the smallest `tl.dot` is 16, and the
    warm path reads whole int32 words of codes)."""
    return max(32, triton.next_power_of_2(head_dim))


def paged_attention(
    q: torch.Tensor,
    layer: PagedLayer,
    plan: PagedAttentionPlan,
    out: torch.Tensor,
    num_segments: int = 1,
    partials: Partials | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    prefix_pages: WarmPrefixPages | None = None,
    warm_unroll: int | None = None,
    block_m: int | None = None,
    branch_free_rescale: bool = False,
    split_causal: bool = False,
) -> torch.Tensor:
    """Attention of packed queries `q` `[T, H, D]` over each row's paged context; writes `out` `[T, H, D]`.

    With `num_segments > 1` the context splits across programs (flash-decoding) and `partials` must
    hold at least `[T, H, num_segments, D_PADDED]`. `tile_n` (positions per loop step, a multiple of
    the block size), `num_warps`, `num_stages` (loads in flight in the software pipeline; Triton's
    default when None), `maxnreg` (a register cap per thread) and `warm_unroll` (warm-loop iterations
    unrolled together; SINGLE_WARP_UNROLL for a one-warp warm decode when None, else 1), `block_m`
    ((token, head) rows per program, a power of two), `branch_free_rescale` (the one-warp warm
    decode's softmax rescale per head without a branch; off: the warp's lazy branch) and
    `split_causal` (a prefill with no warm tier in the kernel: the causal compare only on the tiles
    that cross the diagonal, in a second loop) override the launch shape, which otherwise is 64
    positions and 4 warps, or for a warm decode on a GPU _warm_decode_launch's pick;
    bench/attention_kernel.py compares them. `prefix_pages` (with a layer without a warm tier) is a
    prefill's warm prefix already dequantized: the kernel reads it as hot pages.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = layer.hot_keys.shape
    _check_inputs(q, layer, plan, out, prefix_pages)
    queries_per_kv = num_heads // num_kv_heads
    is_decode = plan.max_query_len == 1
    padded = head_dim_padded(head_dim)
    warm = layer.warm
    if warm is not None and is_decode and q.is_cuda and tile_n is None and num_warps is None:
        tile_n, num_warps, stages, maxnreg = _warm_decode_launch(
            num_kv_heads * num_segments * plan.seq_lens.shape[0], block_size, maxnreg
        )
        num_stages = num_stages or stages
    tile_n = tile_n or _tile_n(block_size)
    num_warps = num_warps or 4
    # a one-warp warm decode builds its tiles in the tensor cores' layout, with the heads as the
    # columns of a transposed tile: eight at least (see _mma_warm_update)
    mma_layout = warm is not None and is_decode and num_warps == 1
    # decode: one query token, so M is just the group's heads; prefill: 64 rows of (token, head)
    default_m = 8 if mma_layout else 16 if is_decode else 64
    block_m = max(block_m or default_m, triton.next_power_of_2(queries_per_kv))
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two: {block_m}")
    block_q = block_m // queries_per_kv
    if tile_n % block_size or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power-of-two multiple of the block size {block_size}: {tile_n}")
    if q.is_cuda and tile_n < MIN_GPU_TILE:
        raise ValueError(f"tile_n must be at least {MIN_GPU_TILE} on a GPU (see MIN_GPU_TILE)")
    if num_segments > 1:
        if num_segments & (num_segments - 1):
            raise ValueError(f"num_segments must be a power of two, got {num_segments}")
        needed = num_tokens * num_heads * num_segments
        if partials is None or partials.max.numel() < needed or partials.out.numel() < needed * padded:
            raise ValueError(f"flash-decoding over {num_segments} segments needs a larger Partials workspace")
    grid = (num_kv_heads * num_segments, triton.cdiv(plan.max_query_len, block_q), plan.seq_lens.shape[0])
    warm_args = _warm_args(warm, layer.hot_keys)
    # without prefix pages, stand-ins that are never read (HAS_PREFIX_PAGES is False)
    pages = prefix_pages or WarmPrefixPages(layer.hot_keys, layer.hot_values, plan.block_tables)
    _paged_attention_kernel[grid](
        out,
        *(partials if num_segments > 1 and partials is not None else (out, out, out)),
        q,
        layer.hot_keys,
        layer.hot_values,
        *pages,
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
        *warm_args[0].stride()[:3],  # in int32 words
        *warm_args[1].stride()[:2],
        *warm_args[4].stride()[:3],
        plan.block_tables.stride(0),
        pages.keys.stride(0),
        LOG2_E / math.sqrt(head_dim),
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCKS_PER_GROUP=layer.blocks_per_group,
        VALUE_GROUP=head_dim // warm.value_scale.shape[-1] if warm is not None else 1,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=padded,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        HAS_WARM=warm is not None,
        HAS_PREFIX_PAGES=prefix_pages is not None,
        IEEE_DOT=q.dtype == torch.float32,
        DECODE=is_decode,
        ASM_DEQUANT=q.is_cuda and q.dtype != torch.float32,
        MMA_LAYOUT=mma_layout,
        WARM_UNROLL=warm_unroll or (SINGLE_WARP_UNROLL if mma_layout else 1),
        BRANCH_FREE_RESCALE=bool(branch_free_rescale),
        SPLIT_CAUSAL=bool(split_causal),
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
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


def _warm_decode_launch(
    programs: int, block_size: int, maxnreg: int | None
) -> tuple[int, int, int | None, int | None]:
    """(tile positions, warps, pipeline stages, register cap) of a warm decode launch of `programs`
    programs on a GPU (None: Triton's default).

    With enough programs to fill the GPU, one warp a program over one-block tiles: it has no
    cross-warp softmax and no barrier between warps, and on the H200 it beat four warps by 15-21%
    at 32K batch 16 and 1K batch 256 (bench/results/decode_gpu_2026-12-02b.md). Its loop pipelines
    its own loads a tile ahead (see _paged_attention_kernel), so it takes one stage: Triton's own
    pipeliner only adds a trip through shared memory for them (a 32K batch-16 layer call: 363 µs at
    Triton's default stages, 340 at one, bench/results/decode_gpu_2026-12-04_key-params.md). With
    fewer programs (a few long rows) one warp each would leave SMs idle, so four warps share a
    64-position tile, with a register cap that lets three programs share an SM."""
    if programs >= SINGLE_WARP_MIN_PROGRAMS:
        return max(block_size, MIN_GPU_TILE), 1, SINGLE_WARP_STAGES, maxnreg
    return _tile_n(block_size), 4, None, WARM_DECODE_MAX_REGISTERS if maxnreg is None else maxnreg


def _tile_n(block_size: int) -> int:
    """Positions per loop step: 64 (whole blocks). On the H200 both tiers measured best there with 4
    warps (bench/attention_kernel.py: 32 or 128 positions, or 8 warps, were 30-90% slower warm)."""
    return 64 if block_size <= 64 else block_size


def _warm_args(warm: WarmLayer | None, hot: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The warm tensors (codes as int32 words), or (with no warm tier) stand-ins of the right rank that
    are never read."""
    if warm is not None:
        return (warm.key_codes.view(torch.int32), warm.key_scale, warm.key_zero,
                warm.value_codes.view(torch.int32), warm.value_scale, warm.value_zero)  # fmt: skip
    codes = hot.view(torch.uint8)[:1]  # [1, ...] never dereferenced: HAS_WARM is False
    return (codes, hot[:1, 0], hot[:1, 0], codes, hot[:1], hot[:1])


def _check_inputs(
    q: torch.Tensor,
    layer: PagedLayer,
    plan: PagedAttentionPlan,
    out: torch.Tensor,
    prefix_pages: WarmPrefixPages | None = None,
) -> None:
    """Shapes, dtypes and strides the kernel assumes; a mistake here would read the wrong memory."""
    pages = prefix_pages
    if pages is not None:
        if layer.warm is not None:
            raise ValueError("prefix pages stand in for the warm tier: pass a layer without one")
        if pages.keys.dtype != q.dtype or pages.keys.shape[1:] != layer.hot_keys.shape[1:]:
            raise ValueError("prefix pages must have the hot pages' dtype and [BS, KVH, D] shape")
        for tensor in (pages.keys, pages.values):
            if tensor.stride() != pages.keys.stride() or tensor.stride()[1:] != layer.hot_keys.stride()[1:]:
                raise ValueError("prefix pages must share the hot pages' layout within a page")
        if pages.tables.dtype != torch.int32 or pages.tables.stride() != plan.block_tables.stride():
            raise ValueError("prefix tables must be int32, laid out as the block tables")
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
    if layer.warm is not None:
        if head_dim % 8:
            raise ValueError(
                f"the fused kernel reads INT4 codes as int32 words of eight channels; head dim {head_dim} is "
                "not a multiple of 8 (use the reference attention backend)"
            )
        value_group = head_dim // layer.warm.value_scale.shape[-1]
        if value_group < 2 or value_group & (value_group - 1):
            raise ValueError(
                f"the fused kernel reads INT4 values in power-of-two channel groups; this cache's group is "
                f"{value_group} channels (set the tier group size to a power of two, or use the reference "
                "attention backend)"
            )
