"""One sequence's map from token positions to KV storage: hot blocks, warm groups, dropped ranges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NewType

import numpy as np

from services.engine.kv.block_pool import SCRATCH_BLOCK, BlockHash, BlockId
from services.engine.kv.tiers import TierConfig

WarmGroupId = NewType("WarmGroupId", int)


class WarmGroups(dict[int, WarmGroupId]):
    """A table's warm groups, first logical block -> group id, that knows when it changes.

    Every step's metadata reads each row's warm blocks as arrays. Building them from the dict took
    tens of microseconds a row on the host (numpy calls per row), every step; the groups change only
    when a group is demoted or evicted, once per group of tokens. So the arrays are kept until the
    next change. Every mutating dict method drops them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arrays: tuple[int, np.ndarray, np.ndarray] | None = None

    def block_arrays(self, blocks_per_group: int) -> tuple[np.ndarray, np.ndarray]:
        """(logical block, warm block) of every block of every warm group, in logical order (reads only;
        the arrays are shared until the next change, so do not write to them)."""
        if self._arrays is None or self._arrays[0] != blocks_per_group:
            firsts = np.fromiter(self.keys(), dtype=np.int64, count=len(self))
            groups = np.fromiter(self.values(), dtype=np.int64, count=len(self))
            order = np.argsort(firsts, kind="stable")
            within = np.arange(blocks_per_group)
            logical = (firsts[order, None] + within).ravel()
            warm = (groups[order, None] * blocks_per_group + within).ravel()
            self._arrays = (blocks_per_group, logical, warm)
        return self._arrays[1], self._arrays[2]

    def _changed(self) -> None:
        self._arrays = None

    def __setitem__(self, key: int, value: WarmGroupId) -> None:
        # unpickling (a plan sent to the other tensor-parallel ranks) sets items before the attributes
        arrays = getattr(self, "_arrays", None)
        if arrays is not None and key not in self and (not self or key > arrays[1][-1]):
            # a group demoted after every other (decode's usual change): extend the kept arrays
            blocks_per_group, logical, warm = arrays
            within = np.arange(blocks_per_group)
            self._arrays = (
                blocks_per_group,
                np.concatenate((logical, key + within)),
                np.concatenate((warm, value * blocks_per_group + within)),
            )
        else:
            self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key: int) -> None:
        self._changed()
        super().__delitem__(key)

    def __ior__(self, other: Any) -> WarmGroups:  # type: ignore[override,misc]
        self._changed()
        return super().__ior__(other)  # type: ignore[return-value]

    def pop(self, *args: Any) -> Any:
        self._changed()
        return super().pop(*args)

    def popitem(self) -> tuple[int, WarmGroupId]:
        self._changed()
        return super().popitem()

    def clear(self) -> None:
        self._changed()
        super().clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key: int, default: Any = None) -> Any:
        self._changed()
        return super().setdefault(key, default)


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
    warm_groups: WarmGroups = field(default_factory=WarmGroups)
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
