"""KV cache storage: an abstract contract plus a contiguous, slot-per-sequence implementation.

The paged, tiered cache of a later issue replaces `ContiguousKVCache` behind the same contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from services.engine.model_config import ModelConfig
from services.engine.step_context import StepContext


class SlotMove(NamedTuple):
    """A sequence's cache contents moved from one slot to another during compaction."""

    from_slot: int
    to_slot: int


class KVCache(ABC):
    """Owns every layer's keys and values. `allocate`, `free` and `store` change state."""

    @abstractmethod
    def num_free_slots(self) -> int:
        """Sequences that can still be admitted."""

    @abstractmethod
    def allocate(self) -> int:
        """Reserve a slot for a new sequence and return it (changes state)."""

    @abstractmethod
    def free(self, slot: int) -> SlotMove | None:
        """Release a slot (changes state); returns the move made to keep slots dense, if any."""

    @abstractmethod
    def store(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new `[B, S, KVH, D]` keys/values; return all visible ones, each `[B, KVH, L, D]`."""


class ContiguousKVCache(KVCache):
    """One `[max_seq_len]` row per sequence, kept dense: live sequences fill slots `0..n-1`.

    Dense slots let a decode step attend over a plain slice `[:n]` (a view, no gather); freeing
    a slot moves the last sequence into the hole, which costs one row copy per finished request.
    """

    def __init__(
        self, config: ModelConfig, max_slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        shape = (config.num_layers, max_slots, config.num_kv_heads, max_seq_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [layers, slots, KVH, T, D]
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # [layers, slots, KVH, T, D]
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.num_used = 0

    def num_free_slots(self) -> int:
        """Slots not held by a live sequence."""
        return self.max_slots - self.num_used

    def allocate(self) -> int:
        """Take the next dense slot."""
        if self.num_used >= self.max_slots:
            raise RuntimeError("no free KV cache slot; check num_free_slots() before allocate()")
        self.num_used += 1
        return self.num_used - 1

    def free(self, slot: int) -> SlotMove | None:
        """Release `slot`, moving the last live slot into it."""
        last = self.num_used - 1
        self.num_used -= 1
        if slot == last:
            return None
        self.keys[:, slot].copy_(self.keys[:, last])
        self.values[:, slot].copy_(self.values[:, last])
        return SlotMove(from_slot=last, to_slot=slot)

    def store(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter new K/V at (slot, position); return the rows' first `kv_len` positions."""
        layer_keys, layer_values = self.keys[layer], self.values[layer]  # [slots, KVH, T, D]
        # advanced indices around a slice: index result is [B, S, KVH, D], matching keys/values
        layer_keys[ctx.write_slots, :, ctx.positions] = keys
        layer_values[ctx.write_slots, :, ctx.positions] = values
        rows = slice(ctx.slot_start, ctx.slot_start + ctx.num_seqs)
        return layer_keys[rows, :, : ctx.kv_len], layer_values[rows, :, : ctx.kv_len]  # [B, KVH, L, D]
