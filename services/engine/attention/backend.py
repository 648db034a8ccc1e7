"""The attention-backend contract: what a model layer calls once its new keys and values are stored."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from services.engine.attention.metadata import AttentionMetadata

# A prefill step over a warm prefix of up to this many tokens reads it as BF16 pages, dequantized
# once per layer (a 32K prompt's second 16K chunk reads a 16K prefix; bench/attention_kernel.py
# --prefill compares the two ways). A longer prefix is read in place, dequantized per query block.
PREFIX_PAGE_TOKENS = 32_768
# ... but only for a step with at least this many new tokens in a row: a shorter chunk reads the warm
# prefix in place, split across programs. On the H200 over a 32K prefix, with the prefix dequantized
# by one launch a layer (prefix_kernel), pages against in place, us a layer call: 1,493 / 1,500 at 512
# new tokens, 2,828 / 2,975 at 1,024, 5,567 / 6,035 at 2,048, 11,351 / 12,622 at 4,096
# (bench/results/decode_gpu_2026-12-05_sweeps.md). Below 512 in place wins (88 against 1,186 us at 16).
PREFIX_PAGES_MIN_QUERY_TOKENS = 1024
PREFIX_DEQUANT_CHUNK_BLOCKS = 256  # warm blocks dequantized at once (bounds the fp32 temporaries)


def prefix_page_bytes(num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Device memory a fused backend holds for a prefill's warm prefix pages, with the dequantizing
    temporaries: reserved before the KV pools are sized (tiers on, fused attention)."""
    pages = 2 * (PREFIX_PAGE_TOKENS + block_size) * num_kv_heads * head_dim * dtype_bytes
    temporaries = 4 * PREFIX_DEQUANT_CHUNK_BLOCKS * block_size * num_kv_heads * head_dim * 4
    return pages + temporaries


class AttentionBackend(ABC):
    """Attention over the paged, tiered KV cache. Reads the cache; never writes it (`KVCache.store` does).

    `forward` must be capturable in a CUDA graph when `supports_graphs` is True: it may then read
    only the metadata's tensors, whose shapes stay fixed for a captured batch size.
    """

    supports_graphs: bool = False
    # Warm blocks a prefill step may have read as dequantized pages (`AttentionMetadata.prefix`);
    # 0: the backend reads the warm tier in place.
    max_prefix_blocks: int = 0
    # The fewest new tokens in a row for which a prefill step reads its warm prefix as pages.
    min_prefix_page_tokens: int = PREFIX_PAGES_MIN_QUERY_TOKENS

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Packed queries `q` `[T, H, D]` (new `k`, `v` `[T, KVH, D]` already stored) -> `[T, H, D]`."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """`forward`, a part at a time on a mixed step (`AttentionMetadata.parts`): its decode rows as a
        decode, its prompt chunks as a prefill, so that neither is padded or launched as the other."""
        if metadata.parts is None:
            return self.forward(q, k, v, layer, metadata)
        return torch.cat([self.forward(q[a:b], k[a:b], v[a:b], layer, part) for a, b, part in metadata.parts])

    def prefix_page_blocks(self, max_query_len: int) -> int:
        """Warm blocks a prefill step with up to `max_query_len` new tokens in a row may read as pages
        (0: it reads the warm tier in place)."""
        return self.max_prefix_blocks if max_query_len >= self.min_prefix_page_tokens else 0

    def wants_dense_prefill(self, max_query_len: int) -> bool:
        """Whether a prefill step whose longest row has `max_query_len` new tokens should be given a
        `DensePrefillPlan` (see dense_prefill); only a backend that runs that path says yes."""
        return False

    def num_segments(self, num_rows: int, max_seq_len: int) -> int:
        """How many programs split each row's context in a decode step (1: no split)."""
        return 1

    def prefill_segments(self, num_tokens: int, num_rows: int, max_query_len: int, max_seq_len: int) -> int:
        """How many programs split each row's context in a prefill step (1: no split)."""
        return 1
