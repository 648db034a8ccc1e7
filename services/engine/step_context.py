"""The per-step state every attention layer reads: where rows live in the cache and what they may see."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepContext:
    """One forward step over `num_seqs` rows that occupy cache slots `[slot_start, slot_start + num_seqs)`.

    Built once per step on the host (no device sync) and shared by all layers.
    """

    slot_start: int
    num_seqs: int
    positions: torch.Tensor  # [B, S] int64: absolute position of each input token
    write_slots: torch.Tensor  # [B, S] int64: cache slot each token's K/V goes to
    kv_len: int  # L: how many cache positions the rows attend over
    attn_mask: torch.Tensor  # [B, 1, S, L] bool: True where a query may attend a cached key

    @property
    def is_prefill(self) -> bool:
        """More than one new token per row."""
        return self.positions.shape[1] > 1

    @classmethod
    def build(cls, slot_start: int, positions: list[list[int]], device: torch.device) -> StepContext:
        """Context for rows whose tokens sit at `positions` (rectangular: pad rows by continuing them)."""
        pos = torch.tensor(positions, dtype=torch.int64)  # [B, S]
        num_seqs = pos.shape[0]
        kv_len = max(max(row) for row in positions) + 1
        key_pos = torch.arange(kv_len, dtype=torch.int64)  # [L]
        mask = key_pos.view(1, 1, 1, kv_len) <= pos.view(num_seqs, 1, -1, 1)  # [B, 1, S, L]
        slots = torch.arange(slot_start, slot_start + num_seqs, dtype=torch.int64)  # [B]
        return cls(
            slot_start=slot_start,
            num_seqs=num_seqs,
            positions=pos.to(device, non_blocking=True),
            write_slots=slots.view(-1, 1).expand_as(pos).to(device, non_blocking=True),
            kv_len=kv_len,
            attn_mask=mask.to(device, non_blocking=True),
        )
