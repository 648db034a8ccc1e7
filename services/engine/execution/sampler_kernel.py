"""The sampler's draw as one Triton program per batch row: `sampler.sample_fused`, for CUDA.

The torch reference (`sampler.sample_reference`, the CPU path) costs about 35 small launches a step,
1.1-2.1 ms on an H100 at batch 1-64 (bench/results/sampler_speed_2026-12-07_h100.md). Here each row's
program reads its settings, finds the row's largest scaled logit (and, for a greedy row, its argmax),
checks that every scaled logit is finite, hashes its uniform, and inverts the fixed-point cumulative
distribution, all in registers. A row that filters (top-k or top-p) is first ranked by `torch.topk` or
`torch.sort` over its scaled logits (`scale_ranked_rows` writes them); the program then inverts in
rank order and maps the rank back to a token id, tied logits ranked by id.

The arithmetic is the reference's, operation for operation: `div_rn` for the temperature (PyTorch's
division is correctly rounded), libdevice's `expf` (the function PyTorch's CUDA `exp` calls), an exact
fp32 product by 2^scale_bits and a truncating cast, exact int64 sums, and the same float64 rounding of
the uniform's target and the top-p threshold. Integer sums cannot depend on the order of their terms,
so a row's blocks may be summed in any order. On the CPU the kernel runs under `TRITON_INTERPRET=1`
in the tests, where `exp` is numpy's and may differ from PyTorch's CPU `exp` by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

NUM_SETTINGS = 6  # per row: slot, top_k, seed, draw index, temperature and top_p (float64 bits)
GREEDY = -2  # the slot of a greedy row
BY_ID = -1  # the slot of a row that draws from its whole vocabulary, in id order
MAX_BLOCK = 8192  # logits per block: 32 KiB in flight per load

_NUM_SETTINGS = tl.constexpr(NUM_SETTINGS)
_GREEDY = tl.constexpr(GREEDY)
_BY_ID = tl.constexpr(BY_ID)
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MIX_1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX_2 = tl.constexpr(0x94D049BB133111EB)
_FAULT = tl.constexpr(-1)  # sampler.FAULT
_LARGEST_FP32 = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _mix(x):
    """The splitmix64 finalizer on uint64 (sampler._mix)."""
    x = x ^ (x >> 30)
    x = x * _MIX_1
    x = x ^ (x >> 27)
    x = x * _MIX_2
    return x ^ (x >> 31)


@triton.jit
def _uniform(seed, draw):
    """float64 in (0, 1), the row's number for its draw (sampler.uniform)."""
    x = _mix(_mix(seed.to(tl.uint64, bitcast=True)) ^ (draw.to(tl.uint64, bitcast=True) * _GOLDEN))
    bits = (x >> 11).to(tl.int64)  # [0, 2^53)
    return (bits.to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53


@triton.jit
def _float_setting(settings, index):
    """A row's fp32 setting, stored as float64 bits (the fp32 that torch.tensor makes of the float)."""
    return tl.load(settings + index).to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def _row_max(row_ptr, vocab, temperature, BLOCK: tl.constexpr):
    """The row's largest scaled logit, the first id that has it, and whether every scaled logit is finite."""
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    num_bad = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        scaled = tl.div_rn(tl.load(row_ptr + offs, mask=mask, other=0.0), temperature)
        num_bad += tl.sum((mask & ~(tl.abs(scaled) <= _LARGEST_FP32)).to(tl.int32))  # NaN compares false
        block_best = tl.max(tl.where(mask, scaled, float("-inf")))
        block_id = tl.min(tl.where(mask & (scaled == block_best), offs, vocab)).to(tl.int64)
        is_better = block_best > best  # ties keep the earlier id, as torch.argmax does
        best_id = tl.where(is_better, block_id, best_id)
        best = tl.where(is_better, block_best, best)
    return best, best_id, num_bad == 0


@triton.jit
def _block_weights(
    row_ptr,
    start,
    width,
    temperature,
    best,
    top_k,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`[BLOCK]` int64 fixed-point weights of ranks (or ids) start.., 0 past `width` and past `top_k`."""
    offs = start + tl.arange(0, BLOCK)
    logits = tl.load(row_ptr + offs, mask=offs < width, other=float("-inf"))
    shifted = tl.div_rn(logits, temperature) - best
    exp = libdevice.exp(shifted) if LIBDEVICE else tl.exp(shifted)  # interpreter: numpy's exp
    weights = (exp * SCALE).to(tl.int64)
    return tl.where(offs < top_k, weights, 0)


@triton.jit
def _total(
    row_ptr,
    width,
    temperature,
    best,
    top_k,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The row's whole weight (after top-k), int64."""
    total = tl.full((), 0, tl.int64)
    for start in range(0, width, BLOCK):
        total += tl.sum(
            _block_weights(row_ptr, start, width, temperature, best, top_k, SCALE, LIBDEVICE, BLOCK)
        )
    return total


@triton.jit
def _is_within(cumulative, bound, IS_THRESHOLD: tl.constexpr):
    """Whether a cumulative weight stays within `bound`: below a float64 top-p threshold, or at most
    an int64 target."""
    return cumulative.to(tl.float64) < bound if IS_THRESHOLD else cumulative <= bound


@triton.jit
def _crossing_block(
    row_ptr,
    width,
    temperature,
    best,
    top_k,
    bound,
    IS_THRESHOLD: tl.constexpr,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The start of the first block whose cumulative weight leaves `bound` (the last block when none
    does) and the weight of the blocks before it.

    Blocks are skipped whole while the cumulative weight through them stays within `bound`; the
    caller sums only the block returned, rank by rank.
    """
    start = tl.full((), 0, tl.int32)
    carry = tl.full((), 0, tl.int64)
    block_sum = tl.sum(
        _block_weights(row_ptr, start, width, temperature, best, top_k, SCALE, LIBDEVICE, BLOCK)
    )
    while (start + BLOCK < width) & _is_within(carry + block_sum, bound, IS_THRESHOLD):
        carry += block_sum
        start += BLOCK
        block_sum = tl.sum(
            _block_weights(row_ptr, start, width, temperature, best, top_k, SCALE, LIBDEVICE, BLOCK)
        )
    return start, carry


@triton.jit
def _kept(
    row_ptr,
    width,
    temperature,
    best,
    top_k,
    threshold,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The cumulative weight through the last rank whose weight before it is below `threshold` (top-p).

    The weight before a rank only grows, so the kept ranks are a prefix, and only the block where it
    ends is summed rank by rank.
    """
    start, carry = _crossing_block(
        row_ptr, width, temperature, best, top_k, threshold, True, SCALE, LIBDEVICE, BLOCK
    )
    weights = _block_weights(row_ptr, start, width, temperature, best, top_k, SCALE, LIBDEVICE, BLOCK)
    cumulative = carry + tl.cumsum(weights, 0)
    offs = start + tl.arange(0, BLOCK)
    is_kept = ((cumulative - weights).to(tl.float64) < threshold) & (offs < width)
    return tl.max(tl.where(is_kept, cumulative, 0))


@triton.jit
def _search(
    row_ptr,
    width,
    temperature,
    best,
    top_k,
    target,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """How many ranks have a cumulative weight at most `target` (searchsorted right), below `width`."""
    start, carry = _crossing_block(
        row_ptr, width, temperature, best, top_k, target, False, SCALE, LIBDEVICE, BLOCK
    )
    weights = _block_weights(row_ptr, start, width, temperature, best, top_k, SCALE, LIBDEVICE, BLOCK)
    offs = start + tl.arange(0, BLOCK)
    is_below = ((carry + tl.cumsum(weights, 0)) <= target) & (offs < width)
    return tl.minimum(start + tl.sum(is_below.to(tl.int64)), width - 1)


@triton.jit
def _invert(
    row_ptr,
    width,
    temperature,
    best,
    top_k,
    top_p,
    u,
    SCALE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The rank (or id) a row draws at `u`: sampler._draw_by_rank's cumulative sums and inversion."""
    total = _total(row_ptr, width, temperature, best, top_k, SCALE, LIBDEVICE, BLOCK)
    kept = total
    if top_p < 1.0:
        threshold = top_p.to(tl.float64) * total.to(tl.float64)
        kept = _kept(row_ptr, width, temperature, best, top_k, threshold, SCALE, LIBDEVICE, BLOCK)
    target = tl.minimum((u * kept.to(tl.float64)).to(tl.int64), kept - 1)
    return _search(row_ptr, width, temperature, best, top_k, target, SCALE, LIBDEVICE, BLOCK)


@triton.jit
def _id_at_rank(logits_ptr, vocab, temperature, ranked_ptr, width, rank, BLOCK: tl.constexpr):
    """The id of the token at `rank` when `topk` ranked the row: sampler._id_at_rank.

    Among the tokens whose scaled logit equals the rank's, it is the j-th lowest id, j counting the
    tied ranks before it.
    """
    value = tl.load(ranked_ptr + rank)
    num_better = tl.full((), 0, tl.int64)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ranked = tl.load(ranked_ptr + offs, mask=offs < width, other=float("-inf"))
        num_better += tl.sum((ranked > value).to(tl.int64))
    j = rank - num_better
    start = tl.full((), 0, tl.int32)
    carry = tl.full((), 0, tl.int64)
    offs = tl.arange(0, BLOCK)
    tied = tl.div_rn(tl.load(logits_ptr + offs, mask=offs < vocab, other=0.0), temperature) == value
    tied = (tied & (offs < vocab)).to(tl.int64)
    while (start + BLOCK < vocab) & (carry + tl.sum(tied) <= j):
        carry += tl.sum(tied)
        start += BLOCK
        offs = start + tl.arange(0, BLOCK)
        tied = tl.div_rn(tl.load(logits_ptr + offs, mask=offs < vocab, other=0.0), temperature) == value
        tied = (tied & (offs < vocab)).to(tl.int64)
    is_before = ((carry + tl.cumsum(tied, 0)) <= j) & (offs < vocab)
    return tl.minimum(start + tl.sum(is_before.to(tl.int64)), vocab - 1)


@triton.jit
def _draw_kernel(
    logits_ptr,  # [B, V] fp32, unit stride along V
    stride_logits,
    settings_ptr,  # [B, NUM_SETTINGS] int64
    ranked_ptr,  # [R, W] fp32: the ranked rows' scaled logits, best first (topk values or sorted)
    stride_ranked,
    order_ptr,  # [R, V] int64: each rank's id, when sorted (HAS_ORDER)
    stride_order,
    out_ptr,  # [B] int64
    vocab,
    width,
    SCALE: tl.constexpr,  # 2^scale_bits
    LIBDEVICE: tl.constexpr,  # exp as CUDA's expf (False in the CPU interpreter, which has no libdevice)
    HAS_ORDER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    settings = settings_ptr + row * _NUM_SETTINGS
    slot = tl.load(settings)
    top_k = tl.load(settings + 1)
    temperature = _float_setting(settings, 4)
    top_p = _float_setting(settings, 5)
    logits_row = logits_ptr + row * stride_logits
    best, best_id, is_finite = _row_max(logits_row, vocab, temperature, BLOCK)
    token = tl.full((), _FAULT, tl.int64)
    if is_finite:
        token = best_id  # greedy
        if slot != _GREEDY:
            u = _uniform(tl.load(settings + 2), tl.load(settings + 3))
            if slot == _BY_ID:
                token = _invert(logits_row, vocab, temperature, best, vocab, 1.0, u, SCALE, LIBDEVICE, BLOCK)
            else:
                ranked_row = ranked_ptr + slot * stride_ranked
                rank = _invert(
                    ranked_row,
                    width,
                    tl.full((), 1.0, tl.float32),
                    best,
                    top_k,
                    top_p,
                    u,
                    SCALE,
                    LIBDEVICE,
                    BLOCK,
                )
                if HAS_ORDER:
                    token = tl.load(order_ptr + slot * stride_order + rank)
                else:
                    token = _id_at_rank(logits_row, vocab, temperature, ranked_row, width, rank, BLOCK)
    tl.store(out_ptr + row, token)


@triton.jit
def _scale_kernel(logits_ptr, stride_logits, settings_ptr, scaled_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    settings = settings_ptr + row * _NUM_SETTINGS
    if tl.load(settings) >= 0:  # a ranked row
        temperature = _float_setting(settings, 4)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            logits = tl.load(logits_ptr + row * stride_logits + offs, mask=offs < vocab, other=0.0)
            scaled = tl.div_rn(logits, temperature)
            tl.store(scaled_ptr + tl.load(settings) * vocab + offs, scaled, mask=offs < vocab)


def _check(logits: torch.Tensor, settings: torch.Tensor) -> None:
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be fp32 [B, V] with unit stride along V, got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")  # fmt: skip
    expected = (logits.shape[0], NUM_SETTINGS)
    if settings.dtype != torch.int64 or tuple(settings.shape) != expected or not settings.is_contiguous():
        raise ValueError(f"settings must be contiguous int64 {expected}, got {tuple(settings.shape)}")
    if settings.device != logits.device:
        raise ValueError(f"settings are on {settings.device}, logits on {logits.device}")


def _block(vocab: int, block: int | None) -> int:
    return block or min(MAX_BLOCK, triton.next_power_of_2(vocab))


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def scale_ranked_rows(
    logits: torch.Tensor, settings: torch.Tensor, num_ranked: int, block: int | None = None
) -> torch.Tensor:
    """`[R, V]` fp32 the ranked rows' logits over their temperature, row `slot` for each ranked row."""
    _check(logits, settings)
    batch, vocab = logits.shape
    scaled = torch.empty(num_ranked, vocab, dtype=torch.float32, device=logits.device)
    size = _block(vocab, block)
    _scale_kernel[(batch,)](
        logits, logits.stride(0), settings, scaled, vocab, BLOCK=size, num_warps=_num_warps(size)
    )
    return scaled


def draw(
    logits: torch.Tensor,
    settings: torch.Tensor,
    ranked: torch.Tensor | None,
    order: torch.Tensor | None,
    scale_bits: int,
    block: int | None = None,
) -> torch.Tensor:
    """`[B]` int64: each row's token (or FAULT), as `sampler.sample_reference` picks it.

    `settings` `[B, NUM_SETTINGS]` int64 gives each row's slot (GREEDY, BY_ID, or its row in
    `ranked`), top-k, seed, draw index, and temperature and top-p as float64 bits (temperature 1 for
    a greedy row). `ranked` `[R, W]` holds the ranked rows' scaled logits best first, and `order`
    `[R, V]` their ids when they were sorted rather than `topk`-ed.
    """
    _check(logits, settings)
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if ranked is None:
        ranked = logits[:0]  # no ranked rows: never read
    if ranked.dtype != torch.float32 or ranked.dim() != 2 or ranked.stride(1) != 1:
        raise ValueError(f"ranked must be fp32 [R, W] with unit stride along W, got {tuple(ranked.shape)}")
    if order is not None and (order.dtype != torch.int64 or order.shape != (ranked.shape[0], vocab)):
        raise ValueError(f"order must be int64 [R, V] = {(ranked.shape[0], vocab)}, got {tuple(order.shape)}")
    size = _block(vocab, block)
    _draw_kernel[(batch,)](
        logits, logits.stride(0), settings, ranked, ranked.stride(0),
        settings if order is None else order, 0 if order is None else order.stride(0),
        out, vocab, ranked.shape[1],
        SCALE=float(1 << scale_bits), LIBDEVICE=logits.is_cuda, HAS_ORDER=order is not None,
        BLOCK=size, num_warps=_num_warps(size),
    )  # fmt: skip
    return out
