"""The profiling step that sizes the KV pools on CUDA: the peak activation memory of the largest steps.

After the weights load and before the KV pools exist, the engine runs the steps that need the most
scratch memory, on a throwaway cache just large enough for them: a prefill of `max_prefill_tokens`
tokens in one row, a decode step of `max_decode_rows` rows, and one chunk of batched demotions. The
allocator's peak above what was allocated before, less the throwaway cache itself, is the activation
peak; `kv.capacity.budget_from_device_memory` subtracts it from the KV budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.engine.attention.metadata import AttentionMetadata, HostMetadata, RowInput
from services.engine.execution.model_runner import make_attention_backend
from services.engine.kv.block_table import BlockTable, WarmGroupId
from services.engine.kv.cache import HotTier, KVCache, WarmCopy, WarmTier
from services.engine.kv.tiers import TierConfig
from services.engine.model.llama import LlamaModel

logger = logging.getLogger(__name__)

# Device memory kept out of the KV budget for what the profile does not see: the decode graphs' memory
# pool (capture comes after the pools are allocated), the NCCL and cuBLAS workspaces, allocator slack.
GRAPH_AND_WORKSPACE_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class MemoryProfile:
    """What the device holds before the KV pools: totals from the driver, the peak from the allocator."""

    total_bytes: int
    used_bytes: int  # the driver's used memory after the profile (weights, CUDA context, other processes)
    activation_peak_bytes: int  # allocator peak during the profile, above the weights and the throwaway cache

    def describe(self) -> str:
        """One log line."""
        gib = 1 << 30
        return (
            f"device memory {self.total_bytes / gib:.1f} GiB, in use {self.used_bytes / gib:.2f} GiB "
            f"after the weights, activation peak {self.activation_peak_bytes / gib:.2f} GiB"
        )


@torch.inference_mode()
def profile_memory(
    model: LlamaModel,
    device: torch.device,
    dtype: torch.dtype,
    attention: str,
    block_size: int,
    tiers: TierConfig,
    max_prefill_tokens: int,
    max_decode_rows: int,
    chunk_tokens: int = 0,
) -> MemoryProfile:
    """Run the largest steps on a throwaway cache and measure (CUDA only; one rank, no TP). The
    backend made here builds the dense prefill path's plans for `chunk_tokens` (the prompt chunk),
    while the KV pools do not take the memory yet; cuDNN keeps them for the engine's backend."""
    if device.type != "cuda":
        raise ValueError("memory profiling is for CUDA; the CPU budget is THERMOCLINE_ENGINE_CPU_KV_CACHE_MB")
    config = model.rank_config
    max_prefill_tokens = min(max_prefill_tokens, model.rotary.max_positions)  # positions past it don't exist
    group_size = tiers.group_size if tiers.enabled else block_size
    num_tokens = max(max_prefill_tokens, group_size)
    num_blocks = -(-num_tokens // block_size) + 1
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hot = HotTier(config, num_blocks, block_size, device, dtype)
    chunk = min(hot.warm_copy_chunk(group_size), (num_blocks - 1) * block_size // group_size)
    warm = WarmTier(config, chunk, group_size, device) if tiers.enabled else None
    cache = KVCache(hot, warm)
    cache_bytes = torch.cuda.memory_allocated(device) - before
    backend = make_attention_backend(attention, cache, model, max_decode_rows, chunk_tokens)

    table = BlockTable(tiers)
    cache.grow(table, max_prefill_tokens)
    ids = torch.randint(0, config.vocab_size, (max_prefill_tokens,), device=device)
    prefill = AttentionMetadata.for_rows([RowInput(table, 0, max_prefill_tokens)], block_size, 1, device)
    hidden = model(ids, cache, backend, prefill)
    model.compute_logits(hidden[-1:])
    del hidden

    rows = [RowInput(table, 0, 1)] * max_decode_rows  # one token each; they may share a block
    host = HostMetadata.build(rows, block_size, 1)
    decode = AttentionMetadata.to_device(host, device, backend.num_segments(max_decode_rows, 1))
    hidden = model(torch.zeros(max_decode_rows, dtype=torch.int64, device=device), cache, backend, decode)
    model.compute_logits(hidden)
    del hidden

    if warm is not None:
        blocks_per_group = group_size // block_size
        ids_of = table.hot_block_ids
        copies = [
            WarmCopy(tuple(ids_of[g * blocks_per_group : (g + 1) * blocks_per_group]), WarmGroupId(g))
            for g in range(chunk)
        ]
        cache.copy_to_warm(copies)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - cache_bytes
    del cache, hot, warm, backend, ids
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    profile = MemoryProfile(total, total - free, max(0, peak))
    logger.info("%s", profile.describe())
    return profile
