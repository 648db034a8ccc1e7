"""The hot tier's block pool: fixed-size pages, reference counts, and the prefix cache over them.

A block is `block_size` token positions of every layer's keys and values. Full blocks are
content-hashed (parent hash, token ids, model id, tenant salt), so a later request with the same
prefix and salt can reuse them instead of recomputing them. Blocks nobody references but whose
contents are still cached stay findable until evicted, least recently freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NewType

BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)

SCRATCH_BLOCK = BlockId(0)  # never handed out: padded rows and empty table entries point here


def hash_block(parent: BlockHash | None, token_ids: Seq[int], model_id: str, salt: str) -> BlockHash:
    """Content hash of one full block; chaining the parent makes it a hash of the whole prefix."""
    digest = hashlib.sha256()
    digest.update(parent or b"root")
    digest.update(model_id.encode())
    digest.update(b"\0" + salt.encode() + b"\0")
    digest.update(",".join(map(str, token_ids)).encode())
    return BlockHash(digest.digest())


def hash_prefix_blocks(token_ids: Seq[int], block_size: int, model_id: str, salt: str) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], model_id, salt)
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    """One page of the hot tier; `block_hash` is set once the block is full and registered."""

    block_id: BlockId
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass
class PrefixCacheStats:
    """Lifetime prefix-cache counters (blocks, not tokens)."""

    num_queried_blocks: int = 0
    num_hit_blocks: int = 0
    num_evicted_blocks: int = 0


class BlockPool:
    """Owns `num_blocks` blocks (block 0 is the scratch block). Calls that change state:
    `allocate`, `share`, `free`, `register`; `can_allocate`, `lookup` and the counts only read.

    Free blocks with no cached contents sit in a plain list (order does not matter); free blocks
    that still hold a registered prefix sit in an OrderedDict keyed by block id, oldest first, so
    that reuse (`share`) removes one from the middle in O(1) and eviction pops the least recently
    freed one. A deque would make the removal on reuse O(n).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the block pool needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.block_size = block_size
        self.blocks = [Block(BlockId(i)) for i in range(num_blocks)]
        self._free: list[BlockId] = [BlockId(i) for i in range(num_blocks - 1, 0, -1)]
        self._evictable: OrderedDict[BlockId, None] = OrderedDict()
        self._by_hash: dict[BlockHash, BlockId] = {}
        self.stats = PrefixCacheStats()
        # blocks handed out by `allocate` since the start: a step prepared ahead compares it at launch
        self.num_allocated_total = 0

    @property
    def num_blocks(self) -> int:
        """Blocks that can ever be handed out (the scratch block excluded)."""
        return len(self.blocks) - 1

    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now, cached-but-unreferenced ones included."""
        return len(self._free) + len(self._evictable)

    def num_used_blocks(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - self.num_free_blocks()

    def can_allocate(self, num_blocks: int) -> bool:
        """True when `allocate(num_blocks)` would succeed."""
        return num_blocks <= self.num_free_blocks()

    def allocate(self, num_blocks: int) -> list[BlockId]:
        """Hand out fresh blocks with ref_count 1, evicting cached ones (LRU) when the free list is empty."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(
                f"{num_blocks} blocks asked, {self.num_free_blocks()} free; call can_allocate first"
            )
        self.num_allocated_total += num_blocks
        return [self._take_one() for _ in range(num_blocks)]

    def _take_one(self) -> BlockId:
        if self._free:
            block_id = self._free.pop()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(self.blocks[block_id])
            self.stats.num_evicted_blocks += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _forget_hash(self, block: Block) -> None:
        if block.block_hash is not None and self._by_hash.get(block.block_hash) == block.block_id:
            del self._by_hash[block.block_hash]
        block.block_hash = None

    def lookup(self, hashes: Seq[BlockHash]) -> list[BlockId]:
        """Cached blocks for the longest prefix of `hashes` found (reads only)."""
        found: list[BlockId] = []
        for block_hash in hashes:
            block_id = self._by_hash.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        self.stats.num_queried_blocks += len(hashes)
        self.stats.num_hit_blocks += len(found)
        return found

    def num_cached_prefix(self, hashes: Seq[BlockHash]) -> int:
        """Leading `hashes` cached now, without counting a query (reads only)."""
        for index, block_hash in enumerate(hashes):
            if block_hash not in self._by_hash:
                return index
        return len(hashes)

    def share(self, block_ids: Seq[BlockId]) -> None:
        """Take one more reference on each cached block (prefix reuse)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1

    def free(self, block_ids: Seq[BlockId]) -> None:
        """Drop one reference on each block; unreferenced blocks become free or evictable."""
        for block_id in reversed(block_ids):  # tail first: a prefix's head stays cached longest
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release(block)

    def _release(self, block: Block) -> None:
        if block.block_hash is None:
            self._free.append(block.block_id)
        else:
            self._evictable[block.block_id] = None

    def register(self, block_id: BlockId, block_hash: BlockHash) -> None:
        """Mark a full block's contents as the prefix `block_hash`; the first block to claim it keeps it."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self._by_hash.setdefault(block_hash, block_id)
