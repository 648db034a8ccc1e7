"""A prefill step as dense fused attention: each row's new tokens over its cached prefix with no mask,
and over themselves causally, merged by log-sum-exp.

Every cached position of a row precedes all of its new tokens, so the new tokens' attention over the
prefix needs no mask, and softmax over a set of positions does not depend on their order. The prefix
can then be read from wherever it lies as a few dense rectangles: its warm blocks dequantized a piece
at a time into the backend's pages (any length of warm prefix: a piece fills the pages at most), its
hot blocks gathered in pieces. Each rectangle is one call of a library kernel that runs the tensor
cores at close to their peak; only the new tokens over themselves need a causal mask. Each part
returns its output with the log-sum-exp of its scores, and `merge` combines them exactly.

On an H100, a 4,096-token chunk after a 32K-token prefix (Llama-3.1-8B heads, tiers on) takes 4.8 ms
a layer this way against 10.0 ms in the paged Triton kernel over the same pages
(bench/results/dense_prefill_2026-12-06.md).

On CUDA the rectangles run cuDNN's attention, with the query heads that share a KV head folded into
its rows (no mask, so rows are independent and a KV head needs no copy per query head). The causal
parts run cuDNN too, a row at a time, or FlashAttention's variable-length kernel over all rows at
once when a step has many (`CudaOps.causal`).

cuDNN builds an execution plan for every new shape it meets: about 40 ms on an H100, 0.5 s when it
compiles a kernel for it. Prompt lengths are arbitrary, so left alone it would build plans on most
requests' last chunk. `CudaOps` therefore shows it a bounded set of shapes, built once at start-up
(`build_plans`): queries of exactly the engine's chunk length, and keys in whole multiples of
PLAN_KEY_GRANULE. The rest goes to FlashAttention, which has no plans: a rectangle's last keys
(fewer than the granule), and rows of any other length.
Elsewhere `ReferenceOps` computes the same parts in fp32: the oracle the CUDA ops are tested against,
and what CPU tests run the split and merge with.
Shapes: T packed new tokens, C one row's new tokens, P prefix positions in a part, H/KVH heads, D dim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from services.engine.kv.block_pool import SCRATCH_BLOCK

logger = logging.getLogger(__name__)

# A prefill step takes this path when its longest row has at least this many new tokens ... On an
# H100, per layer call against the paged kernel over the warm prefix's pages: 547 against 681 us for
# 1,024 new tokens after 8K, 1,218 against 2,400 after 32K; at 512 new tokens the paged kernel's split
# still wins after 8K (393 against 928 us) and loses after 32K (1,306 against 925).
DENSE_PREFILL_MIN_QUERY_TOKENS = 1024
# ... and at most this many rows have a cached prefix (each is a Python loop over its parts, a few
# launches a layer). A mixed step's decode rows attend in a part of their own and do not count.
DENSE_PREFILL_MAX_PREFIX_ROWS = 8
# A step of up to this many rows runs their causal parts one row at a time through cuDNN, more in one
# FlashAttention call: on an H100, 385 against 605 us for a 4,096-token row (32 query, 8 KV heads).
CUDNN_SQUARE_MAX_ROWS = 8
# Hot prefix positions gathered into one dense part: bounds the copy buffers, which the KV budget
# reserves (`dense_prefill_bytes`).
DENSE_GATHER_TOKENS = 16_384
# cuDNN sees keys in whole multiples of this many positions, and FlashAttention takes the rest of a
# rectangle: up to a 32K piece that is 64 plans per chunk length (built at start-up in about 6 s on
# an H100), and the FlashAttention call over the last keys of a piece stays small.
PLAN_KEY_GRANULE = 512


class DenseRow(NamedTuple):
    """One row's parts: its new tokens in the packed layout and where its cached prefix lies."""

    start: int  # first packed new token (host int)
    end: int  # one past its last
    warm_blocks: tuple[torch.Tensor, ...]  # int64 warm block ids of its prefix, in pieces that fit the pages
    hot_slots: tuple[torch.Tensor, ...]  # int64 hot slots of its prefix, in pieces of DENSE_GATHER_TOKENS


class DensePrefillPlan(NamedTuple):
    """A prefill step's rows for `dense_prefill_attention`, built once per step on the host."""

    rows: tuple[DenseRow, ...]
    cu_seqlens: torch.Tensor  # [B + 1] int32: packed new tokens per row (the plan's query_start_loc)
    max_query_len: int


class HostRow(NamedTuple):
    """`DenseRow` before its index arrays go to the device."""

    start: int
    end: int
    warm_blocks: tuple[np.ndarray, ...]
    hot_slots: tuple[np.ndarray, ...]


def plan_rows(
    query_start_loc: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    warm_tables: np.ndarray,
    block_size: int,
    max_warm_blocks: int,
) -> list[HostRow] | None:
    """Each row's parts from a step's host metadata, or None when the step cannot take this path: more
    than DENSE_PREFILL_MAX_PREFIX_ROWS rows with a prefix, or a warm prefix where the backend holds no
    pages (`max_warm_blocks`, the warm blocks dequantized at once, is 0)."""
    rows = []
    offsets = np.arange(block_size)
    with_prefix = 0
    for r in range(len(seq_lens)):
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        cached = int(seq_lens[r]) - (end - start)
        num_blocks = -(-cached // block_size)
        with_prefix += cached > 0
        if with_prefix > DENSE_PREFILL_MAX_PREFIX_ROWS:
            return None
        warm_ids = warm_tables[r, :num_blocks]
        warm = warm_ids >= 0
        if warm.any():
            if max_warm_blocks <= 0:
                return None
            # a warm block is a whole block of computed positions (demotion takes full groups)
            assert (np.flatnonzero(warm)[-1] + 1) * block_size <= cached, "a warm block past the prefix"
        blocks = warm_ids[warm].astype(np.int64)
        warm_pieces = tuple(
            blocks[i : i + max_warm_blocks] for i in range(0, len(blocks), max(1, max_warm_blocks))
        )
        hot = (block_tables[r, :num_blocks] != SCRATCH_BLOCK) & ~warm  # warm is read first, as everywhere
        logical = np.flatnonzero(hot)
        positions = (logical[:, None] * block_size + offsets).reshape(-1)
        slots = (block_tables[r, logical].astype(np.int64)[:, None] * block_size + offsets).reshape(-1)
        slots = slots[positions < cached]
        hot_pieces = tuple(
            slots[i : i + DENSE_GATHER_TOKENS] for i in range(0, len(slots), DENSE_GATHER_TOKENS)
        )
        rows.append(HostRow(start, end, warm_pieces, hot_pieces))
    return rows


def to_device_plan(
    rows: list[HostRow], query_start_loc: torch.Tensor, max_query_len: int, device: torch.device
) -> DensePrefillPlan:
    """Move the rows' index arrays to `device` (pinned, non-blocking on CUDA)."""

    def move(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor

    moved = tuple(
        DenseRow(
            row.start,
            row.end,
            tuple(move(piece) for piece in row.warm_blocks),
            tuple(move(piece) for piece in row.hot_slots),
        )
        for row in rows
    )
    return DensePrefillPlan(moved, query_start_loc, max_query_len)


class Attended(NamedTuple):
    """One part's attention: its output and the log-sum-exp (natural log) of each query's scores."""

    out: torch.Tensor  # [C, H, D]
    lse: torch.Tensor  # [C, H] fp32


class ReferenceOps:
    """The two parts in fp32 with plain tensor operations (any device; the oracle). Any shape: the
    arguments are CudaOps' and unused."""

    def __init__(
        self, query_len: int = 0, num_heads: int = 0, num_kv_heads: int = 0, head_dim: int = 0
    ) -> None:
        """Takes CudaOps' arguments, so that either is built the same way; keeps none of them."""

    def build_plans(self, max_keys: int, dtype: torch.dtype, device: torch.device) -> None:
        """Nothing to build."""

    def rectangle(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Attended:
        """`q` `[C, H, D]` over every position of `k`, `v` `[P, KVH, D]`, no mask."""
        return _attend(q, k, v, causal=False)

    def causal(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
        bounds: Sequence[tuple[int, int]],
    ) -> Attended:  # fmt: skip
        """Packed `q` `[T, H, D]` over the same rows' packed `k`, `v` `[T, KVH, D]`, each token over
        its row's tokens up to itself (rows: `bounds`, the `[start, end)` of each in the packing, as
        `cu_seqlens` has them on the device)."""
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for start, end in bounds:
            if end > start:
                out[start:end], lse[start:end] = _attend(
                    q[start:end], k[start:end], v[start:end], causal=True
                )
        return Attended(out, lse)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Attended:
    """`q` `[C, H, D]` over `k`, `v` `[P, KVH, D]` in fp32; `causal`: query i sees positions up to i."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, P, D]
    values = v.float().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ keys.transpose(1, 2) * q.shape[-1] ** -0.5  # [H, C, P]
    if causal:
        future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, -1) @ values  # [H, C, D]
    return Attended(out.transpose(0, 1).to(q.dtype), torch.logsumexp(scores, -1).transpose(0, 1))


class CudaOps:
    """The two parts as fused library kernels: cuDNN attention and FlashAttention's varlen kernel.

    cuDNN gets queries of `query_len` (the engine's prompt chunk) and keys in multiples of
    PLAN_KEY_GRANULE only, so that its plans are a bounded set (`build_plans`); FlashAttention takes
    everything else. `num_heads`, `num_kv_heads` and `head_dim` size the plans built ahead."""

    def __init__(self, query_len: int, num_heads: int = 0, num_kv_heads: int = 0, head_dim: int = 0) -> None:
        self.query_len = query_len
        self.shape = (num_heads, num_kv_heads, head_dim)

    def rectangle(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Attended:
        """`q` `[C, H, D]` over `k`, `v` `[P, KVH, D]` (rows may be strided), no mask: through cuDNN
        over the keys' whole granules when C is the chunk length, the rest through FlashAttention."""
        bulk = k.shape[0] - k.shape[0] % PLAN_KEY_GRANULE
        if q.shape[0] != self.query_len or bulk == 0:
            return _flash_rectangle(q, k, v)
        head = _cudnn_rectangle(q, k[:bulk], v[:bulk])
        if bulk == k.shape[0]:
            return head
        return merge_pair(head, _flash_rectangle(q, k[bulk:], v[bulk:]), head.out)

    def causal(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
        bounds: Sequence[tuple[int, int]],
    ) -> Attended:  # fmt: skip
        """Packed rows, each causal over itself. Up to CUDNN_SQUARE_MAX_ROWS rows of the chunk length go
        one at a time through cuDNN, with the KV heads copied out per query head (cuDNN takes no grouped
        heads under a causal mask); otherwise FlashAttention's varlen kernel takes every row in one
        call, grouped-query natively (a row is square, so its bottom-right causal alignment is the
        usual one)."""
        scale = q.shape[-1] ** -0.5
        rows = [(start, end) for start, end in bounds if end > start]
        if len(rows) > CUDNN_SQUARE_MAX_ROWS or any(end - start != self.query_len for start, end in rows):
            result = torch.ops.aten._flash_attention_forward(
                q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale
            )
            return Attended(result[0], result[1].transpose(0, 1).float())  # lse [H, T] for packed rows
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        group = q.shape[1] // k.shape[1]
        for start, end in rows:
            keys, values = (x[start:end].repeat_interleave(group, 1).transpose(0, 1)[None] for x in (k, v))
            row = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q[start:end].transpose(0, 1)[None], keys, values, None, True, 0.0, True, False, scale=scale
            )
            out[start:end] = row[0][0].transpose(0, 1)
            lse[start:end] = row[1].view(q.shape[1], end - start).transpose(0, 1)
        return Attended(out, lse)

    def build_plans(self, max_keys: int, dtype: torch.dtype, device: torch.device) -> None:
        """Have cuDNN build every plan this path can ask for, for keys up to `max_keys` (the longest
        piece): each rectangle's whole granules and the causal part of one chunk. cuDNN keeps its
        plans for the process, so a second backend of the same shapes finds them built."""
        num_heads, num_kv_heads, head_dim = self.shape
        key = (device, dtype, self.query_len, num_heads, num_kv_heads, head_dim)
        if self.query_len <= 0 or key in _PLANS_BUILT:
            return
        q = torch.zeros(self.query_len, num_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(max(max_keys, self.query_len), num_kv_heads, head_dim, dtype=dtype, device=device)
        bounds = [(0, self.query_len)]
        cu_seqlens = torch.tensor([0, self.query_len], dtype=torch.int32, device=device)
        self.causal(q, k[: self.query_len], k[: self.query_len], cu_seqlens, self.query_len, bounds)
        for keys in range(PLAN_KEY_GRANULE, max_keys + 1, PLAN_KEY_GRANULE):
            _cudnn_rectangle(q, k[:keys], k[:keys])
        torch.cuda.synchronize(device)
        _PLANS_BUILT.add(key)


_PLANS_BUILT: set[tuple] = set()  # (device, dtype, chunk, heads, KV heads, dim) whose plans cuDNN holds


def _cudnn_rectangle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Attended:
    """`q` `[C, H, D]` over `k`, `v` `[P, KVH, D]`, no mask, through cuDNN. The G query heads of each
    KV head become G x C rows of one cuDNN head: with no mask each row is independent."""
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    folded = (
        q.view(length, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * length, dim)
    )
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        folded, k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0),
        None, True, 0.0, False, False, scale=dim**-0.5,
    )  # fmt: skip
    out = result[0].view(kv_heads, group, length, dim).permute(2, 0, 1, 3).reshape(length, heads, dim)
    lse = result[1].view(kv_heads, group, length).permute(2, 0, 1).reshape(length, heads)
    return Attended(out, lse.float())


def _flash_rectangle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Attended:
    """`q` `[C, H, D]` over `k`, `v` `[P, KVH, D]`, no mask, through FlashAttention's varlen kernel
    (grouped-query natively; no plan per shape). The one-row offsets are made on the device."""
    length, keys = q.shape[0], k.shape[0]
    cu_q = torch.arange(0, 2 * length, length, dtype=torch.int32, device=q.device)  # [0, C]
    cu_k = torch.arange(0, 2 * keys, keys, dtype=torch.int32, device=q.device)  # [0, P]
    result = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, length, keys, 0.0, False, False, scale=q.shape[-1] ** -0.5
    )
    return Attended(result[0], result[1].transpose(0, 1).float())


def cuda_ops_work(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether CudaOps run here for these shapes and match ReferenceOps (a small check at start-up:
    cuDNN or FlashAttention may be missing from the build or refuse the head size). Half precision
    only."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False  # cuDNN takes some fp32 too, but an fp32 engine asks for fp32's accuracy
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    # keys past one granule: the rectangle goes through cuDNN and FlashAttention both; the causal
    # part through FlashAttention (two rows) and cuDNN (one row of the chunk length)
    keys = PLAN_KEY_GRANULE + 80
    q, k, v = (
        rand(48, num_heads, head_dim),
        rand(keys, num_kv_heads, head_dim),
        rand(keys, num_kv_heads, head_dim),
    )
    two_rows = torch.tensor([0, 16, 48], dtype=torch.int32, device=device)
    one_row = torch.tensor([0, 48], dtype=torch.int32, device=device)
    try:
        fused, reference = CudaOps(48), ReferenceOps()
        parts = [(fused.rectangle(q, k, v), reference.rectangle(q, k, v))]
        for cu_seqlens, bounds in ((two_rows, [(0, 16), (16, 48)]), (one_row, [(0, 48)])):
            parts.append(
                (
                    fused.causal(q, k[:48], v[:48], cu_seqlens, 48, bounds),
                    reference.causal(q, k[:48], v[:48], cu_seqlens, 48, bounds),
                )
            )
        torch.cuda.synchronize(device)
    except RuntimeError as error:
        logger.info("dense prefill attention unavailable here (%s): prefill stays on the paged kernel", error)
        return False
    for got, want in parts:
        if (got.out.float() - want.out.float()).abs().max() > 0.05 or (got.lse - want.lse).abs().max() > 0.05:
            logger.warning(
                "dense prefill attention disagrees with its reference: prefill stays on the paged kernel"
            )
            return False
    return True


def merge(parts: list[Attended]) -> torch.Tensor:
    """Outputs over disjoint sets of positions -> the output over their union (in the first's dtype)."""
    if len(parts) == 1:
        return parts[0].out
    lse = torch.stack([part.lse for part in parts])  # [N, C, H]
    weights = torch.softmax(lse, 0).unsqueeze(-1)  # each part's share of the union's softmax mass
    out = sum(part.out.float() * weight for part, weight in zip(parts, weights, strict=True))
    assert isinstance(out, torch.Tensor)
    return out.to(parts[0].out.dtype)


def merge_pair(a: Attended, b: Attended, out: torch.Tensor, kernel: bool | None = None) -> Attended:
    """`merge([a, b])` written into `out` `[C, H, D]` (which may be `a.out`), with the union's log-sum-exp.
    `kernel`: one pass of `_merge_pair_kernel` (the default on CUDA), else `merge` (the oracle)."""
    if kernel is None:
        kernel = out.is_cuda
    if not kernel:
        lse = torch.logaddexp(a.lse, b.lse)
        out.copy_(merge([a, b]))
        return Attended(out, lse)
    length, heads, dim = out.shape
    lse = torch.empty(length, heads, dtype=torch.float32, device=out.device)
    for t in (out, a.out, b.out):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    rows = length * heads
    grid = (triton.cdiv(rows, MERGE_ROWS),)
    _merge_pair_kernel[grid](
        out, lse, a.out, a.lse, b.out, b.lse, rows, heads,
        out.stride(0), out.stride(1), a.out.stride(0), a.out.stride(1), b.out.stride(0), b.out.stride(1),
        a.lse.stride(0), a.lse.stride(1), b.lse.stride(0), b.lse.stride(1),
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_R=MERGE_ROWS,
    )  # fmt: skip
    return Attended(out, lse)


MERGE_ROWS = 32  # (token, head) rows a merge program takes


@triton.jit
def _merge_pair_kernel(
    out, out_lse, a, a_lse, b, b_lse, rows, heads,
    s_out_t, s_out_h, s_a_t, s_a_h, s_b_t, s_b_h, s_al_t, s_al_h, s_bl_t, s_bl_h,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """One pass over two parts' outputs: each (token, head) row weighted by its part's share of the
    union's softmax mass, exp(lse_part - lse_union); the union's log-sum-exp goes to `out_lse`
    (contiguous `[C, H]`)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < rows
    t = r // heads
    h = r % heads
    la = tl.load(a_lse + t * s_al_t + h * s_al_h, mask=valid, other=0.0)
    lb = tl.load(b_lse + t * s_bl_t + h * s_bl_h, mask=valid, other=0.0)
    top = tl.maximum(la, lb)
    wa = tl.exp(la - top)
    wb = tl.exp(lb - top)
    total = wa + wb
    d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (d < DIM)[None, :]
    av = tl.load(a + (t * s_a_t + h * s_a_h)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    bv = tl.load(b + (t * s_b_t + h * s_b_h)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    merged = av * (wa / total)[:, None] + bv * (wb / total)[:, None]
    tl.store(
        out + (t * s_out_t + h * s_out_h)[:, None] + d[None, :], merged.to(out.dtype.element_ty), mask=mask
    )
    tl.store(out_lse + r, top + tl.log(total), mask=valid)


def dense_prefill_attention(
    ops: ReferenceOps | CudaOps,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    hot: tuple[torch.Tensor, torch.Tensor],
    dequantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None,
    plan: DensePrefillPlan,
    out: torch.Tensor,
) -> torch.Tensor:
    """Packed queries `q` `[T, H, D]` with their new keys and values `k`, `v` `[T, KVH, D]` over each row's
    prefix and itself; writes `out` `[T, H, D]`. The prefix is read from the `hot` keys and values
    `[N, BS, KVH, D]` and from warm blocks through `dequantize` (warm block ids `[S]` -> their keys and
    values `[S * BS, KVH, D]`, valid until its next call)."""
    bounds = [(row.start, row.end) for row in plan.rows]
    own = ops.causal(q, k, v, plan.cu_seqlens, plan.max_query_len, bounds)
    hot_k, hot_v = hot[0].flatten(0, 1), hot[1].flatten(0, 1)  # [N * BS, KVH, D]
    out.copy_(own.out)
    for row in plan.rows:  # each part is merged in as it is computed, so at most one is held
        queries = q[row.start : row.end]
        merged = Attended(out[row.start : row.end], own.lse[row.start : row.end])
        for blocks in row.warm_blocks:
            assert dequantize is not None, "a warm prefix and no way to dequantize it"
            merged = merge_pair(merged, ops.rectangle(queries, *dequantize(blocks)), merged.out)
        for slots in row.hot_slots:
            merged = merge_pair(merged, ops.rectangle(queries, hot_k[slots], hot_v[slots]), merged.out)
    return out


def dense_prefill_bytes(
    max_prefill_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Device memory a dense prefill step may allocate beyond the model's own activations: one gathered
    piece of hot keys and values, and over the longest row the causal part's output, the folded
    queries and one rectangle's output, with slack for the library kernels' reshapes."""
    gathered = 2 * DENSE_GATHER_TOKENS * num_kv_heads * head_dim * dtype_bytes
    parts = 4 * max_prefill_tokens * num_heads * head_dim * dtype_bytes
    return gathered + parts
