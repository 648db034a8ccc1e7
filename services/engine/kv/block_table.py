"""One sequence's map from token positions to KV storage: hot blocks, warm groups, dropped ranges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from services.engine.kv.block_pool import SCRATCH_BLOCK, BlockHash, BlockId
from services.engine.kv.tiers import TierConfig

WarmGroupId = NewType("WarmGroupId", int)


@dataclass
class BlockTable:
    """Block `i` covers positions `[i*block_size, (i+1)*block_size)`.

    `hot_block_ids[i]` is the hot block or SCRATCH_BLOCK once demoted or dropped; `warm_groups`
    maps the first block index of each warm group to its group id (a group spans several blocks).
    """

    tiers: TierConfig
    hot_block_ids: list[BlockId] = field(default_factory=list)
    warm_groups: dict[int, WarmGroupId] = field(default_factory=dict)
    prefix_hashes: list[BlockHash] = field(default_factory=list)  # hashes of the prompt's full blocks
    num_registered_blocks: int = 0  # leading blocks whose hash the pool knows
    next_demote_block: int = -1  # first block index not yet demoted; -1 until tiers start
    num_dropped_blocks: int = 0

    def held_hot_blocks(self) -> list[BlockId]:
        """Hot blocks this table references."""
        return [b for b in self.hot_block_ids if b != SCRATCH_BLOCK]
