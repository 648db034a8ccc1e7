"""The cold tier's moves in a step plan, and the summary keys that choose which cold blocks come back.

The scheduler decides moves (`ColdStore`, `ColdLoad`) on the engine thread; the model runner
carries them out before the forward: stores read their hot blocks or warm group first (before
this step's warm copies may reuse the group), loads write their hot blocks last (after the warm
copies have read the blocks they free). A store of a warm group also records the group's summary
key (Quest: channel-wise min and max of the keys at one layer) in device memory, so a later query
can bound its attention score to the block without loading it.
Shapes: L layers, T tokens in the block, KVH kv heads, D head dim, H query heads, N cold blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from services.common.kvstore_api import BlockHash, Codec
from services.engine.kv.block_pool import BlockId
from services.engine.kv.block_table import WarmGroupId
from services.engine.kv.cold_tier import Operation

if TYPE_CHECKING:
    from services.engine.scheduling.sequence import Sequence


@dataclass(frozen=True)
class ColdStore:
    """Copy one block to the host and store it: hot blocks (a prompt block) or a warm group."""

    operation: Operation  # STORE_PREFIX (hot blocks, raw) or DEMOTE (a warm group, INT2)
    seq: Sequence
    block_hash: BlockHash
    hot_block_ids: tuple[BlockId, ...] = ()
    warm_group: WarmGroupId | None = None
    summary_slot: int | None = None  # demotions: where the block's summary key goes

    @property
    def codec(self) -> Codec:
        """Prompt blocks are reused as they were computed (raw); demoted ones are INT2."""
        return Codec.RAW if self.operation is Operation.STORE_PREFIX else Codec.INT2_SPARSE


@dataclass(frozen=True)
class ColdLoad:
    """Write an auxiliary window's blocks that came back from the store into hot blocks `[n]`:
    `kv` `[n, L, 2, BS, KVH, D]`, on the host; the runner copies them in on every rank. (A loaded
    prefix does not come this way: the loader thread writes it itself, `KVCache.prefix_writer`.)
    """

    hot_block_ids: tuple[BlockId, ...]
    kv: torch.Tensor

    @classmethod
    def of_tokens(
        cls, hot_block_ids: tuple[BlockId, ...], keys: torch.Tensor, values: torch.Tensor
    ) -> ColdLoad:
        """From keys and values `[L, n*BS, KVH, D]` (a window block's kept tokens); a view, no copy."""
        stacked = torch.stack([keys, values], dim=1)  # [L, 2, n*BS, KVH, D]
        blocks = stacked.unflatten(2, (len(hot_block_ids), -1))  # [L, 2, n, BS, KVH, D]
        return cls(hot_block_ids, blocks.permute(2, 0, 1, 3, 4, 5))


class ScoreRow(NamedTuple):
    """A decode row whose query scores its cold blocks this step."""

    row: int
    owner: str  # the request id (its summaries)
    num_slots: int
    num_blocks: int  # how many to choose


@dataclass
class ColdMoves:
    """The cold-tier moves decided since the runner last took them."""

    stores: list[ColdStore] = field(default_factory=list)
    loads: list[ColdLoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads)


class ColdSummaries:
    """Per sequence, the summary keys of its cold blocks at one layer, in device memory.

    Slot `i` is the sequence's i-th cold block (the order of its demotions). Written by the runner
    when it carries out a demotion; read when a decode step's query scores the blocks.
    """

    def __init__(self, layer: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.layer = layer
        self.device = device
        self._shape = (num_kv_heads, head_dim)
        self._key_min: dict[str, torch.Tensor] = {}  # request id -> [N, KVH, D] fp32
        self._key_max: dict[str, torch.Tensor] = {}

    def add(self, owner: str, slot: int, keys: torch.Tensor) -> None:
        """Record slot `slot` of `owner` from its keys `[L, T, KVH, D]` (changes state)."""
        low, high = self._grown(owner, slot + 1)
        layer_keys = keys[self.layer].float()  # [T, KVH, D]
        low[slot], high[slot] = layer_keys.amin(0), layer_keys.amax(0)

    def _grown(self, owner: str, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        low = self._key_min.get(owner)
        if low is None or low.shape[0] < num_slots:
            size = max(num_slots, 2 * (0 if low is None else low.shape[0]), 8)
            new_low = torch.zeros(size, *self._shape, device=self.device)
            new_high = torch.zeros_like(new_low)
            if low is not None:
                new_low[: low.shape[0]] = low
                new_high[: low.shape[0]] = self._key_max[owner]
            self._key_min[owner], self._key_max[owner] = new_low, new_high
        return self._key_min[owner], self._key_max[owner]

    def scores(self, owner: str, num_slots: int, query: torch.Tensor) -> torch.Tensor:
        """Upper bounds of `query` `[H, D]` . k over each of the first `num_slots` blocks: `[N]` fp32."""
        low, high = self._key_min[owner][:num_slots], self._key_max[owner][:num_slots]  # [N, KVH, D]
        return quest_scores(query, low, high)

    def forget(self, owner: str) -> None:
        """Drop a finished (or preempted) sequence's summaries (changes state)."""
        self._key_min.pop(owner, None)
        self._key_max.pop(owner, None)

    def __contains__(self, owner: str) -> bool:
        return owner in self._key_min


def quest_scores(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Quest's bound: per head, sum over channels of max(q*min, q*max); summed over heads -> `[N]`.

    `query` `[H, D]`, `key_min`/`key_max` `[N, KVH, D]`; GQA: each kv head serves H/KVH query heads.
    """
    _, num_kv_heads, head_dim = key_min.shape
    grouped = query.float().view(num_kv_heads, -1, head_dim)  # [KVH, G, D]
    lower = grouped.unsqueeze(0) * key_min.unsqueeze(2)  # [N, KVH, G, D]
    upper = grouped.unsqueeze(0) * key_max.unsqueeze(2)
    return torch.maximum(lower, upper).sum(-1).sum((1, 2))  # [N]
