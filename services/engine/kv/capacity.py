"""How large the KV pools are: a byte budget for the cache, split into hot blocks and warm groups.

On CUDA the budget is `utilization * total device memory` less what is already in use after the
weights load and less the peak activation memory that a profiling step measures. On the CPU it is
a fixed setting, and the pools never exceed what `max_batch_size` sequences of `max_seq_len` need.

With the tiers off every byte becomes hot blocks. With the tiers on, the split follows one sequence's
footprint at `max_seq_len` (its sink, its hot window with the group awaiting demotion, and its warm
groups), so that the number of concurrent long sequences is as large as the budget allows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.engine.kv.tiers import KVCacheSpec, TierConfig
from services.engine.model.config import ModelConfig

GIB = 1 << 30


def format_bytes(n: float) -> str:
    """`1.50 GiB`, `12.0 MiB`, `512 B`: sizes in error messages and logs."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def hot_block_bytes(config: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """Device bytes of one hot block: keys and values, all layers (the HotTier layout)."""
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype_bytes


def warm_group_bytes(config: ModelConfig, group_size: int) -> int:
    """Device bytes of one INT4 warm group, all layers (the WarmTier layout).

    Codes: two per byte for keys and values. Keys: an fp16 scale and zero per channel per group.
    Values: an fp16 scale and zero per token per channel group of `min(group_size, head_dim)`.
    """
    heads, dim = config.num_kv_heads, config.head_dim
    codes = 2 * group_size * heads * (dim // 2)
    key_params = 2 * heads * dim * 2
    value_params = 2 * group_size * heads * (dim // min(group_size, dim)) * 2
    return config.num_layers * (codes + key_params + value_params)


@dataclass(frozen=True)
class SequenceFootprint:
    """What one sequence of `max_seq_len` tokens holds at most: hot blocks and warm groups."""

    hot_blocks: int
    warm_groups: int


def footprint(
    max_seq_len: int, block_size: int, tiers: Iterable[TierConfig], tiers_enabled: bool
) -> SequenceFootprint:
    """The largest footprint over the deployment's tier settings (intent classes may widen them).

    With tiers, a sequence holds its sink blocks, its hot window plus the group that has left the
    window but waits for the step's demotion, one block being filled, and up to `warm_tokens` of warm
    groups plus the one allocated before the warm limit is applied.
    """
    full = -(-max_seq_len // block_size)
    if not tiers_enabled:
        return SequenceFootprint(full, 0)
    hot, warm = 0, 0
    for t in tiers:
        sink = -(-t.sink_tokens // block_size)
        window = -(-(t.hot_tokens_cap + t.group_size) // block_size) + 1
        hot = max(hot, min(full, sink + window))
        if t.warm_tokens > 0:  # groups leave only once `hot_tokens` newer positions exist
            outside = max(0, max_seq_len - t.hot_tokens)
            warm = max(warm, min(-(-outside // t.group_size), -(-t.warm_tokens // t.group_size) + 1))
    return SequenceFootprint(hot, warm)


@dataclass(frozen=True)
class PoolPlan:
    """The KV pools to allocate and what they hold."""

    num_hot_blocks: int  # the scratch block included
    num_warm_groups: int  # 0 with the tiers off
    block_size: int
    group_size: int
    hot_block_bytes: int
    warm_group_bytes: int
    max_seq_len: int
    budget_bytes: int  # what the pools were allowed
    concurrent_sequences: int  # sequences of max_seq_len tokens that fit at once

    @property
    def hot_tokens(self) -> int:
        """Token positions the hot pool holds (the scratch block excluded)."""
        return (self.num_hot_blocks - 1) * self.block_size

    @property
    def warm_tokens(self) -> int:
        """Token positions the warm pool holds."""
        return self.num_warm_groups * self.group_size

    @property
    def kv_bytes(self) -> int:
        """Bytes the two pools allocate."""
        return self.num_hot_blocks * self.hot_block_bytes + self.num_warm_groups * self.warm_group_bytes

    def describe(self) -> str:
        """One log line: the pools, their bytes, and the concurrency at max_seq_len."""
        warm = ""
        if self.warm_tokens:
            warm = f", warm {self.warm_tokens:,} tokens in {self.num_warm_groups:,} INT4 groups"
        return (
            f"KV cache {self.kv_bytes / GIB:.2f} GiB of a {self.budget_bytes / GIB:.2f} GiB budget: "
            f"hot {self.hot_tokens:,} tokens in {self.num_hot_blocks - 1:,} blocks{warm}; "
            f"{self.concurrent_sequences:,} concurrent sequences of max_seq_len {self.max_seq_len:,}"
        )


class KVBudgetTooSmall(ValueError):
    """The budget cannot hold one sequence of the requested length."""


def plan_pools(
    config: ModelConfig,
    spec: KVCacheSpec,
    class_tiers: Iterable[TierConfig],
    budget_bytes: int,
    dtype_bytes: int,
    max_seq_len: int,
    max_batch_size: int,
    max_prefill_tokens: int,
    cap_at_need: bool,
) -> PoolPlan:
    """Split `budget_bytes` into pools (explicit pool sizes in `spec` win over the budget).

    `cap_at_need` (the CPU) stops at what `max_batch_size` sequences of `max_seq_len` need;
    otherwise (CUDA) the whole budget is used, the surplus as hot blocks for the prefix cache.
    """
    tiers = spec.tiers
    hb = hot_block_bytes(config, spec.block_size, dtype_bytes)
    wb = warm_group_bytes(config, tiers.group_size) if tiers.enabled else 0
    seq = footprint(max_seq_len, spec.block_size, [tiers, *class_tiers], tiers.enabled)
    # a prefill step writes up to max_prefill_tokens new tokens hot before any of them is demoted
    prefill_reserve = -(-min(max_prefill_tokens, max_seq_len) // spec.block_size) if tiers.enabled else 0
    per_seq = seq.hot_blocks * hb + seq.warm_groups * wb
    fixed = (1 + prefill_reserve) * hb + (wb if tiers.enabled and not seq.warm_groups else 0)
    fit = max(0, (budget_bytes - fixed) // per_seq)  # scratch block, prefill reserve, the one warm group
    if fit < 1 and not spec.pools_set_by_hand:
        raise KVBudgetTooSmall(
            f"a KV budget of {format_bytes(budget_bytes)} holds no sequence of {max_seq_len} tokens (one "
            f"needs {format_bytes(per_seq)}, plus {format_bytes(fixed)} for the scratch block and the "
            "prefill reserve)"
        )
    if cap_at_need:
        fit = min(fit, max_batch_size)
    hot = 1 + prefill_reserve + fit * seq.hot_blocks
    warm = max(fit * seq.warm_groups, 1) if tiers.enabled else 0
    if not cap_at_need:  # the rest of the budget: more hot blocks (prefix reuse, short sequences)
        hot += max(0, budget_bytes - hot * hb - warm * wb) // hb
    if spec.num_hot_blocks:
        hot = spec.num_hot_blocks
    if spec.num_warm_groups and tiers.enabled:
        warm = spec.num_warm_groups
    fits = _concurrent(hot, warm, seq, prefill_reserve)
    return PoolPlan(hot, warm, spec.block_size, tiers.group_size, hb, wb, max_seq_len, budget_bytes, fits)


def _concurrent(hot: int, warm: int, seq: SequenceFootprint, prefill_reserve: int) -> int:
    by_hot = (hot - 1 - prefill_reserve) // seq.hot_blocks
    by_warm = warm // seq.warm_groups if seq.warm_groups else by_hot
    return max(0, min(by_hot, by_warm))


def longest_fitting_seq_len(
    config: ModelConfig, spec: KVCacheSpec, budget_bytes: int, dtype_bytes: int, limit: int
) -> int:
    """The longest sequence whose hot blocks fit the budget alone (tiers off), at most `limit`.

    With the tiers on, a sequence's footprint stops growing past its tier sizes, so any length up
    to the model's own limit fits once one footprint does.
    """
    if spec.tiers.enabled:
        return limit
    blocks = budget_bytes // hot_block_bytes(config, spec.block_size, dtype_bytes) - 1  # less scratch
    return max(0, min(limit, blocks * spec.block_size))


def budget_from_device_memory(
    total_bytes: int, used_bytes: int, activation_peak_bytes: int, utilization: float, reserve_bytes: int
) -> int:
    """`utilization * total` less memory in use now, the measured activation peak and a fixed reserve."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"GPU memory utilization must be in (0, 1], got {utilization}")
    return math.floor(utilization * total_bytes) - used_bytes - activation_peak_bytes - reserve_bytes
