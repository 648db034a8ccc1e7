"""One sequence's map from token positions to KV storage: hot blocks, warm groups, dropped ranges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NewType

from services.engine.kv.block_pool import SCRATCH_BLOCK, BlockHash, BlockId
from services.engine.kv.tiers import TierConfig

WarmGroupId = NewType("WarmGroupId", int)


@dataclass
class ColdBlock:
    """A block that left the warm tier for the kvstore: its store hash and its summary slot."""

    block_hash: str
    slot: int  # index of its summary key (ColdSummaries)
    is_stored: bool = False  # the store acknowledged it; only stored blocks can come back


@dataclass
class BlockTable:
    """Block `i` covers positions `[i*block_size, (i+1)*block_size)`.

    `hot_block_ids[i]` is the hot block or SCRATCH_BLOCK once demoted or dropped; `warm_groups`
    maps the first block index of each warm group to its group id (a group spans several blocks).
    A cold block chosen for the auxiliary window is loaded into spare hot blocks and mapped at its
    own positions in `hot_block_ids` (listed in `aux_blocks`), so attention reads it as hot.
    """

    tiers: TierConfig
    hot_block_ids: list[BlockId] = field(default_factory=list)
    warm_groups: dict[int, WarmGroupId] = field(default_factory=dict)
    prefix_hashes: list[BlockHash] = field(default_factory=list)  # hashes of the prompt's full blocks
    num_registered_blocks: int = 0  # leading blocks whose hash the pool knows
    next_demote_block: int = -1  # first block index not yet demoted; -1 until tiers start
    num_dropped_blocks: int = 0
    hot_floor: int = 0  # hot window starts no earlier than this position (a chat-turn boundary)
    keeps_cold: bool = False  # warm overflow goes to the kvstore instead of being dropped
    cold_blocks: dict[int, ColdBlock] = field(default_factory=dict)  # first block index -> cold block
    aux_blocks: dict[int, tuple[BlockId, ...]] = field(default_factory=dict)  # cold block loaded into hot

    def held_hot_blocks(self) -> list[BlockId]:
        """Hot blocks this table references."""
        return [b for b in self.hot_block_ids if b != SCRATCH_BLOCK]
