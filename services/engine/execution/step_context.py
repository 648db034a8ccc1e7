"""The per-step state every attention layer reads: where each token's K/V goes and what each row sees."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.engine.kv.block_pool import SCRATCH_BLOCK
from services.engine.kv.block_table import BlockTable


class RowInput(NamedTuple):
    """One batch row: its block table and the new tokens' positions `[start, start + num_new)`."""

    table: BlockTable
    start: int
    num_new: int


@dataclass(frozen=True)
class StepContext:
    """One forward step over B rows of S new tokens (rows shorter than S are padded at the end).

    Built once per step on the host from block tables (no device sync) and shared by all layers.
    """

    positions: torch.Tensor  # [B, S] int64: absolute position of each input token
    slot_mapping: torch.Tensor  # [B, S] int64: hot slot (block * BS + offset) each K/V goes to
    gather_slots: torch.Tensor  # [B, L] int64: hot slot each visible position reads (scratch if not hot)
    attn_mask: torch.Tensor  # [B, 1, S, L] bool: True where a query may attend a cached key
    warm_group_ids: torch.Tensor | None  # [n] int64: warm groups the batch reads, or None
    warm_rows: torch.Tensor | None  # [n, G] int64: batch row of each warm token
    warm_positions: torch.Tensor | None  # [n, G] int64: position of each warm token
    probe: AttentionProbe | None = None  # set on sampled decode steps: measure mass on hot tokens

    @property
    def is_prefill(self) -> bool:
        """More than one new token per row."""
        return self.positions.shape[1] > 1

    @classmethod
    def build(
        cls, rows: Seq[RowInput], block_size: int, device: torch.device, probe_layer: int | None = None
    ) -> StepContext:
        """Context for `rows`; each table must already hold blocks for its new positions.

        With `probe_layer`, that layer also records the share of attention mass on hot tokens.
        """
        width = max(row.num_new for row in rows)
        kv_len = max(row.start + row.num_new for row in rows)
        pos = torch.tensor([_row_positions(r, width) for r in rows], dtype=torch.int64)  # [B, S]
        hot_slots, present = _hot_slots(rows, block_size, kv_len)  # [B, L] each
        probe = None if probe_layer is None else AttentionProbe.build(probe_layer, present, device)
        slot_mapping = _slot_mapping(rows, hot_slots, pos)  # [B, S]
        warm = _warm_index(rows, block_size, present)
        key_pos = torch.arange(kv_len, dtype=torch.int64)
        causal = key_pos.view(1, 1, 1, kv_len) <= pos.view(len(rows), 1, -1, 1)  # [B, 1, S, L]
        mask = causal & present.view(len(rows), 1, 1, kv_len)
        return cls(
            positions=_to(pos, device),
            slot_mapping=_to(slot_mapping, device),
            gather_slots=_to(hot_slots, device),
            attn_mask=_to(mask, device),
            warm_group_ids=None if warm is None else _to(warm[0], device),
            warm_rows=None if warm is None else _to(warm[1], device),
            warm_positions=None if warm is None else _to(warm[2], device),
            probe=probe,
        )


@dataclass(frozen=True)
class AttentionProbe:
    """Where one layer writes the batch's mean share of attention mass on hot positions."""

    layer: int
    is_hot: torch.Tensor  # [B, 1, 1, L] bool
    hot_mass: torch.Tensor  # [1] fp32, written on the device; read (one sync) only when sampled

    @classmethod
    def build(cls, layer: int, is_hot: torch.Tensor, device: torch.device) -> AttentionProbe:
        """A probe over a copy of the rows' hot-position mask `[B, L]`."""
        mask = is_hot.clone().view(is_hot.shape[0], 1, 1, -1)
        return cls(layer, _to(mask, device), torch.ones(1, device=device))

    def record(self, q: torch.Tensor, keys: torch.Tensor, attn_mask: torch.Tensor) -> None:
        """Reference softmax of `q` `[B, H, S, D]` over `keys` `[B, KVH, L, D]`; keep the hot share."""
        groups = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(groups, dim=1)  # [B, H, L, D]
        scores = (q.float() @ keys.float().transpose(-1, -2)) / q.shape[-1] ** 0.5  # [B, H, S, L]
        weights = scores.masked_fill(~attn_mask, float("-inf")).softmax(-1)
        self.hot_mass.copy_((weights * self.is_hot).sum(-1).mean().view(1))


def _row_positions(row: RowInput, width: int) -> list[int]:
    """The row's new positions; padding repeats the last one, so no position passes the row's end
    (rows resuming from a cached prefix share a step with full prompts and must stay in RoPE range)."""
    last = row.start + row.num_new - 1
    return list(range(row.start, last + 1)) + [last] * (width - row.num_new)


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def _hot_slots(rows: Seq[RowInput], block_size: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hot slot of every position `[B, L]` (scratch when not hot) and whether it holds a token."""
    num_blocks = -(-kv_len // block_size)
    table = torch.full((len(rows), num_blocks), SCRATCH_BLOCK, dtype=torch.int64)
    ends = torch.tensor([r.start + r.num_new for r in rows], dtype=torch.int64)  # [B]
    for i, row in enumerate(rows):
        ids = row.table.hot_block_ids[:num_blocks]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    offsets = torch.arange(kv_len, dtype=torch.int64)
    slots = table[:, offsets // block_size] * block_size + offsets % block_size  # [B, L]
    is_hot = table[:, offsets // block_size] != SCRATCH_BLOCK
    present = is_hot & (offsets.view(1, -1) < ends.view(-1, 1))
    slots = torch.where(is_hot, slots, torch.zeros_like(slots))
    return slots, present


def _slot_mapping(rows: Seq[RowInput], hot_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where each new token's K/V is written (`positions` `[B, S]`); padded tokens write to scratch slot 0."""
    mapping = hot_slots.gather(1, positions)  # [B, S]
    width = positions.shape[1]
    is_real = torch.arange(width).view(1, -1) < torch.tensor([r.num_new for r in rows]).view(-1, 1)
    return torch.where(is_real, mapping, torch.zeros_like(mapping))


def _warm_index(
    rows: Seq[RowInput], block_size: int, present: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Warm groups to dequantize, with the (row, position) of each of their tokens; marks them present."""
    entries = [(i, first, gid) for i, r in enumerate(rows) for first, gid in r.table.warm_groups.items()]
    if not entries:
        return None
    group_size = rows[entries[0][0]].table.tiers.group_size
    group_ids = torch.tensor([gid for _, _, gid in entries], dtype=torch.int64)  # [n]
    row_ids = torch.tensor([i for i, _, _ in entries], dtype=torch.int64).view(-1, 1).expand(-1, group_size)
    starts = torch.tensor([first * block_size for _, first, _ in entries], dtype=torch.int64)
    positions = starts.view(-1, 1) + torch.arange(group_size).view(1, -1)  # [n, G]
    present[row_ids, positions] = True
    return group_ids, row_ids.contiguous(), positions
