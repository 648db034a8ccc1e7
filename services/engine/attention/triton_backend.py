"""The fused path: one Triton kernel reads hot pages and INT4 warm groups in place (see paged_kernels)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import triton

from services.engine.attention import prefix_kernel
from services.engine.attention.backend import (
    PREFIX_DEQUANT_CHUNK_BLOCKS,
    PREFIX_PAGE_TOKENS,
    AttentionBackend,
)
from services.engine.attention.dense_prefill import (
    DENSE_GATHER_TOKENS,
    DENSE_PREFILL_MIN_QUERY_TOKENS,
    CudaOps,
    cuda_ops_work,
    dense_prefill_attention,
)
from services.engine.attention.metadata import AttentionMetadata, PrefixPlan
from services.engine.attention.paged_kernels import (
    SINGLE_WARP_MIN_PROGRAMS,
    PagedLayer,
    Partials,
    WarmPrefixPages,
    head_dim_padded,
    paged_attention,
)
from services.engine.kv.cache import KVCache
from services.engine.kv.kivi import dequantize_keys, dequantize_values

MAX_SEGMENTS = 32  # flash-decoding split cap (the merge kernel reads them all)
MIN_TOKENS_PER_SEGMENT = 256  # below this a split costs more in merging than it gains
# Enough programs to keep ~8 resident per SM of an H100/H200 (132 SMs): a decode program's loop is
# latency-bound (block-table load, then the tile's loads), so occupancy is what hides memory latency.
TARGET_PROGRAMS = 8 * 132
# With a warm tier, a decode splits until it has the programs of the one-warp launch, which reads the
# warm tier in the tensor cores' layout (paged_kernels: SINGLE_WARP_MIN_PROGRAMS), where the context
# gives each segment at least 8 one-block tiles: one row at 32K takes 128 segments, 16 rows at 1K 8.
# Fewer programs take the four-warp launch, which costs about 1.4x the instructions per position.
MAX_WARM_SEGMENTS = 128
MIN_WARM_TOKENS_PER_SEGMENT = 128
# A prefill splits too when it has few query blocks over a long context: a 16-token chunk after a
# 32K-token prefix (a prefix-cache or cold-tier hit, a short follow-up turn) is one query block per
# KV head, and unsplit its 8 programs each scan all 32K positions. The split is capped by the
# flash-decoding workspace, which holds PREFILL_SPLIT_TOKENS (token, segment) pairs at least.
MAX_PREFILL_SEGMENTS = 64
PREFILL_SPLIT_TOKENS = 2048
PREFILL_BLOCK_M = 64  # (token, head) rows per prefill program (paged_attention's block_m)
# Whether a backend built from now on runs long prefill steps as dense library attention where it can
# (dense_prefill; the startup check must pass too); benches switch it off to time the paged kernel.
DENSE_PREFILL = True
# paged_attention's launch overrides for steps with a prefill (empty: the kernel's defaults), read by
# each backend when it is built; bench/attention_kernel.py times candidates alone and
# bench/decode_gpu.py --prefill-launch end to end. PREFILL_LAUNCH is for a prefill that reads the
# cache in place (no warm tier, or a short chunk), PREFIX_PAGES_LAUNCH for one whose warm prefix is
# read as pages: 128 positions and 128 (token, head) rows a program in 8 warps, with the causal
# compare only on the tiles that cross the diagonal. On an H100 that launch took a 4,096-token chunk
# over a 32K prefix from 10.5 to 10.0 ms a layer and a 32K prompt's TTFT (8B, tiers on) from 2.02 to
# 1.94 s; without a warm tier it was slower than the kernel's default, 8.8 against 8.4 ms
# (bench/results/prefill_launch_2026-12-06.md).
PREFILL_LAUNCH: dict[str, Any] = {}
PREFIX_PAGES_LAUNCH: dict[str, Any] = {"tile_n": 128, "num_warps": 8, "block_m": 128, "split_causal": True}

logger = logging.getLogger(__name__)


class TritonBackend(AttentionBackend):
    """Fused paged attention over both tiers; capturable in a CUDA graph (decode).

    Decode reads the warm tier in place. A prefill step over a warm prefix of up to
    `PREFIX_PAGE_TOKENS` reads it as pages of the hot layout instead: each layer dequantizes the
    step's warm blocks once (`AttentionMetadata.prefix`), where in place every block of queries
    would dequantize the whole prefix in registers again (a 16K-token chunk is 256 such blocks).

    On CUDA, a prefill step with a row of at least DENSE_PREFILL_MIN_QUERY_TOKENS new tokens runs as
    dense library attention instead (`dense_prefill`), which dequantizes any length of warm prefix
    into the same pages a piece at a time and gathers hot blocks, when the step's rows allow it
    (`AttentionMetadata.dense`) and the library kernels passed their check at start-up;
    `dense_prefill = False` keeps every step on the paged kernel.
    """

    supports_graphs = True

    def __init__(
        self, kv_cache: KVCache, num_heads: int, max_decode_rows: int, chunk_tokens: int = 0
    ) -> None:
        self.kv_cache = kv_cache
        self.layers = [_layer_view(kv_cache, layer) for layer in range(kv_cache.hot.keys.shape[0])]
        self.num_kv_heads = kv_cache.hot.keys.shape[-2]
        head_dim = kv_cache.hot.keys.shape[-1]
        device = kv_cache.hot.keys.device
        # flash-decoding workspace: one entry per (row, head, segment) of the largest split a decode
        # of up to max_decode_rows rows takes (few rows split many ways, many rows few)
        self.max_split_rows = max(r * self._segments(r, 1 << 30) for r in range(1, max_decode_rows + 1))
        self.max_split_tokens = max(self.max_split_rows, PREFILL_SPLIT_TOKENS)  # prefill splits too
        self.queries_per_kv = num_heads // self.num_kv_heads
        self.prefill_launch = dict(PREFILL_LAUNCH)
        self.prefix_pages_launch = dict(PREFIX_PAGES_LAUNCH)
        self.partials = Partials.empty(self.max_split_tokens, num_heads, 1, head_dim_padded(head_dim), device)
        self.max_prefix_blocks = 0
        self.num_prefix_layer_calls = 0  # layer calls that read a prefill's warm prefix from pages
        self.num_split_layer_calls = 0  # eager decode layer calls split across programs (flash-decoding)
        self.num_dense_layer_calls = 0  # prefill layer calls that took the dense path
        self.dense_ops = (
            CudaOps(chunk_tokens, num_heads, self.num_kv_heads, head_dim)
            if cuda_ops_work(device, kv_cache.hot.keys.dtype, num_heads, self.num_kv_heads, head_dim)
            else None
        )
        self.dense_prefill = DENSE_PREFILL and self.dense_ops is not None
        self._prefix_pages: tuple[torch.Tensor, torch.Tensor] | None = None
        if kv_cache.warm is not None:  # pages 1..S hold a prefill's warm blocks; page 0 is never read
            block_size = kv_cache.block_size
            self.max_prefix_blocks = PREFIX_PAGE_TOKENS // block_size
            shape = (self.max_prefix_blocks + 1, block_size, self.num_kv_heads, head_dim)
            dtype = kv_cache.hot.keys.dtype
            self._prefix_pages = (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`[T, H, D]` -> `[T, H, D]`."""
        out = torch.empty_like(q)
        paged_layer = self.layers[layer]
        if metadata.dense is not None and self.dense_ops is not None:
            self.num_dense_layer_calls += 1
            hot = (paged_layer.hot_keys, paged_layer.hot_values)
            dequantize = None if paged_layer.warm is None else partial(self._dequantize_piece, paged_layer)
            return dense_prefill_attention(self.dense_ops, q, k, v, hot, dequantize, metadata.dense, out)
        if metadata.prefix is not None and paged_layer.warm is not None:
            pages = self._dequantize_prefix(paged_layer, metadata.prefix)
            in_place = paged_layer._replace(warm=None)  # the warm blocks are read from the pages
            partials = self.partials if metadata.num_segments > 1 else None
            return paged_attention(
                q, in_place, metadata.paged, out, metadata.num_segments, partials, prefix_pages=pages,
                **self.prefix_pages_launch,
            )  # fmt: skip
        partials = self.partials if metadata.num_segments > 1 else None
        self.num_split_layer_calls += metadata.num_segments > 1
        launch: dict[str, Any] = self.prefill_launch if metadata.paged.max_query_len > 1 else {}
        return paged_attention(q, paged_layer, metadata.paged, out, metadata.num_segments, partials, **launch)

    def build_dense_plans(self) -> None:
        """Have cuDNN build the dense path's plans now, for pieces up to the longest this backend reads
        (`CudaOps.build_plans`), instead of on the first requests that meet each shape. Short of
        memory, they are built as they are met."""
        if not self.dense_prefill or self.dense_ops is None:
            return
        keys = self.kv_cache.hot.keys
        longest = max(DENSE_GATHER_TOKENS, self.max_prefix_blocks * self.kv_cache.block_size)
        try:
            self.dense_ops.build_plans(longest, keys.dtype, keys.device)
        except torch.OutOfMemoryError:
            logger.warning("no memory to build the dense prefill plans ahead: cuDNN builds them as met")

    def wants_dense_prefill(self, max_query_len: int) -> bool:
        """Whether a step whose longest row has `max_query_len` new tokens should be offered the dense
        path (the metadata then decides whether its rows allow it)."""
        return (
            self.dense_prefill
            and self.dense_ops is not None
            and max_query_len >= DENSE_PREFILL_MIN_QUERY_TOKENS
        )

    def prefix_page_blocks(self, max_query_len: int) -> int:
        """The pages serve the dense path too, from its shortest chunk."""
        if self.wants_dense_prefill(max_query_len):
            return self.max_prefix_blocks
        return super().prefix_page_blocks(max_query_len)

    def num_segments(self, num_rows: int, max_seq_len: int) -> int:
        """Enough programs to fill the GPU (with a warm tier: to take the one-warp launch), but no
        segment under MIN_TOKENS_PER_SEGMENT (MIN_WARM_TOKENS_PER_SEGMENT) positions."""
        segments = self._segments(num_rows, max_seq_len)
        return segments if num_rows * segments <= self.max_split_rows else 1

    def prefill_segments(self, num_tokens: int, num_rows: int, max_query_len: int, max_seq_len: int) -> int:
        """The split of a prefill step: enough programs to fill the GPU when its query blocks are few
        and its contexts long, no segment under MIN_TOKENS_PER_SEGMENT positions, and no more
        (token, segment) pairs than the workspace holds. A whole prompt is rarely split: its own
        query blocks fill the GPU."""
        # the launch the step will take: its warm prefix read as pages, or (often) the cache in place
        launch = self.prefix_pages_launch if self.prefix_page_blocks(max_query_len) else self.prefill_launch
        block_q = max(1, launch.get("block_m", PREFILL_BLOCK_M) // self.queries_per_kv)
        programs = self.num_kv_heads * triton.cdiv(max_query_len, block_q) * num_rows
        by_occupancy = triton.cdiv(TARGET_PROGRAMS, programs)
        by_length = max_seq_len // MIN_TOKENS_PER_SEGMENT
        by_workspace = self.max_split_tokens // max(1, num_tokens)
        wanted = min(MAX_PREFILL_SEGMENTS, by_occupancy, by_length, by_workspace)
        return 1 if wanted < 2 else 1 << (wanted.bit_length() - 1)

    def _segments(self, num_rows: int, max_seq_len: int) -> int:
        if self.kv_cache.warm is not None:
            target, cap, shortest = SINGLE_WARP_MIN_PROGRAMS, MAX_WARM_SEGMENTS, MIN_WARM_TOKENS_PER_SEGMENT
        else:
            target, cap, shortest = TARGET_PROGRAMS, MAX_SEGMENTS, MIN_TOKENS_PER_SEGMENT
        by_occupancy = triton.cdiv(target, num_rows * self.num_kv_heads)
        by_length = triton.cdiv(max_seq_len, shortest)
        wanted = max(1, min(cap, by_occupancy, by_length))
        return 1 << (wanted.bit_length() - 1)  # the merge kernel needs a power of two

    def _fill_pages(self, layer: PagedLayer, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Warm blocks `blocks` `[S]` of `layer` into pages 1..S of the held buffers -> pages 0..S."""
        assert self._prefix_pages is not None
        self.num_prefix_layer_calls += 1
        keys, values = self._prefix_pages
        count = blocks.shape[0]
        dequantize_prefix(layer, blocks, keys[: count + 1], values[: count + 1])
        return keys[: count + 1], values[: count + 1]

    def _dequantize_piece(self, layer: PagedLayer, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Warm blocks `blocks` `[S]` of `layer` (S at most max_prefix_blocks) -> their keys and values
        `[S * BS, KVH, D]`, in the held pages until the next call (the dense path's pieces)."""
        keys, values = self._fill_pages(layer, blocks)
        return keys[1:].flatten(0, 1), values[1:].flatten(0, 1)

    def _dequantize_prefix(self, layer: PagedLayer, prefix: PrefixPlan) -> WarmPrefixPages:
        """This layer's warm blocks of `prefix` into pages 1..S of the held buffers."""
        return WarmPrefixPages(*self._fill_pages(layer, prefix.blocks), prefix.tables)


def dequantize_prefix(
    layer: PagedLayer, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Warm blocks `blocks` `[S]` of `layer` into pages 1..S of `keys` and `values` `[S + 1, BS, KVH, D]`
    (kivi's dequantization, rounded once to the pages' dtype; page 0 is left as it is). On CUDA one
    fused launch (prefix_kernel); elsewhere dequantize_prefix_reference."""
    warm = layer.warm
    assert warm is not None
    if keys.is_cuda and prefix_kernel.supports(warm.key_codes, keys):
        prefix_kernel.dequantize_prefix(*warm, layer.blocks_per_group, blocks, keys, values)
    else:
        dequantize_prefix_reference(layer, blocks, keys, values)


def dequantize_prefix_reference(
    layer: PagedLayer, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """dequantize_prefix with kivi's functions, a chunk of blocks at a time (the fused kernel's oracle)."""
    warm = layer.warm
    assert warm is not None
    for start in range(0, blocks.shape[0], PREFIX_DEQUANT_CHUNK_BLOCKS):
        chunk = blocks[start : start + PREFIX_DEQUANT_CHUNK_BLOCKS]
        groups = chunk // layer.blocks_per_group
        into = slice(1 + start, 1 + start + chunk.shape[0])
        keys[into] = dequantize_keys(warm.key_codes[chunk], warm.key_scale[groups], warm.key_zero[groups])
        values[into] = dequantize_values(
            warm.value_codes[chunk], warm.value_scale[chunk], warm.value_zero[chunk]
        )


def _layer_view(kv_cache: KVCache, layer: int) -> PagedLayer:
    warm = kv_cache.warm
    if warm is None:
        return PagedLayer(kv_cache.hot.keys[layer], kv_cache.hot.values[layer], None, 1)
    views = warm.layer_views(layer, kv_cache.block_size)
    return PagedLayer(
        kv_cache.hot.keys[layer], kv_cache.hot.values[layer], views, warm.group_size // kv_cache.block_size
    )
