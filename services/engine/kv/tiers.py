"""How a sequence's KV cache is split between the hot (model dtype) and warm (INT4) tiers."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class WarmFullPolicy(enum.Enum):
    """What happens when a sequence's warm tier is full."""

    WINDOW = "window"  # drop the oldest warm groups: sliding-window attention past the warm tier
    REFUSE = "refuse"  # refuse requests that could outgrow sink + warm + hot at admission


@dataclass(frozen=True)
class TierConfig:
    """Tier sizes in tokens; `enabled=False` keeps every token hot (exactly the untiered engine)."""

    enabled: bool = False
    sink_tokens: int = 4
    hot_tokens: int = 128
    warm_tokens: int = 4096
    group_size: int = 32  # INT4 group: tokens per key group, channels per value group (capped at head dim)
    policy: WarmFullPolicy = WarmFullPolicy.WINDOW
    # Attention-driven boundaries. A sequence whose sampled share of attention mass on hot tokens
    # falls below `grow_below_hot_mass` gets one more group of hot window, up to `max_hot_tokens`
    # (0: hot never grows); with `restart_hot_at_turns`, an end-of-text or chat-turn token starts
    # the hot window afresh (older tokens may leave it at once).
    max_hot_tokens: int = 0
    grow_below_hot_mass: float = 0.5
    restart_hot_at_turns: bool = False

    def __post_init__(self) -> None:
        for name in ("sink_tokens", "hot_tokens", "warm_tokens", "max_hot_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0.0 <= self.grow_below_hot_mass <= 1.0:
            raise ValueError(f"grow_below_hot_mass must be in [0, 1], got {self.grow_below_hot_mass}")

    @property
    def hot_tokens_cap(self) -> int:
        """The widest the hot window can grow (what the pools are sized for)."""
        return max(self.hot_tokens, self.max_hot_tokens)

    def grown(self) -> TierConfig | None:
        """These tiers with one more group of hot window, or None at the cap."""
        if self.hot_tokens >= self.max_hot_tokens:
            return None
        return dataclasses.replace(
            self, hot_tokens=min(self.hot_tokens + self.group_size, self.max_hot_tokens)
        )

    @property
    def max_tokens(self) -> int:
        """Tokens a sequence may hold under the `refuse` policy."""
        return self.sink_tokens + self.hot_tokens_cap + self.warm_tokens

    def check_head_dim(self, head_dim: int) -> None:
        """Values are quantized per token in groups of min(group_size, head dim) channels, which must
        tile the head: a group that does not would fail at the first demotion, mid-request."""
        value_group = min(self.group_size, head_dim)
        if self.enabled and head_dim % value_group:
            raise ValueError(
                f"INT4 group_size {self.group_size} does not fit this model's head dim {head_dim}: each "
                f"token's values are quantized in groups of min(group_size, head dim) = {value_group} "
                f"channels, which must divide {head_dim}. Pick a group size that divides {head_dim} (and "
                "is a multiple of the KV block size), or one at least as large, or turn the tiers off"
            )

    def check_block_size(self, block_size: int) -> None:
        """Warm groups are whole blocks: the group size must be a multiple of the block size."""
        if self.enabled and self.group_size % block_size:
            raise ValueError(
                f"INT4 group_size {self.group_size} must be a multiple of the KV block size {block_size}"
            )


@dataclass(frozen=True)
class KVCacheSpec:
    """Deployment-wide KV cache layout: block size, pool sizes (0 = derived) and the tiers."""

    block_size: int = 16
    num_hot_blocks: int = 0  # 0: sized from the memory budget (kv/capacity.py); set: scratch block included
    num_warm_groups: int = 0  # 0: derived from the budget
    tiers: TierConfig = TierConfig()
    # CUDA: the share of device memory the engine may use in all (weights, activations, KV pools)
    gpu_memory_utilization: float = 0.90
    # CPU: the KV pools' byte budget; they stop at what max_batch_size sequences of max_seq_len need
    cpu_cache_mb: int = 512

    @property
    def pools_set_by_hand(self) -> bool:
        """Both pools are given (the warm one only matters with the tiers on): no budget is derived."""
        return bool(self.num_hot_blocks and (self.num_warm_groups or not self.tiers.enabled))

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"KV block_size must be >= 1, got {self.block_size}")
        if self.num_hot_blocks < 0 or self.num_warm_groups < 0:
            raise ValueError("KV pool sizes must be >= 0 (0 derives them from the memory budget)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"GPU memory utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_cache_mb < 1:
            raise ValueError(f"the CPU KV cache budget must be >= 1 MB, got {self.cpu_cache_mb}")
        self.tiers.check_block_size(self.block_size)
