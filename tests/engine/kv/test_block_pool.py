"""BlockPool and prefix hashing on a tiny pool: allocate, free, reference counts, chaining, LRU."""

from __future__ import annotations

import pytest

from services.engine.kv.block_pool import SCRATCH_BLOCK, BlockPool, hash_block, hash_prefix_blocks


def test_allocate_and_free_track_reference_counts() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.num_blocks == 4 and pool.num_free_blocks() == 4
    blocks = pool.allocate(3)
    assert SCRATCH_BLOCK not in blocks and len(set(blocks)) == 3
    assert all(pool.blocks[b].ref_count == 1 for b in blocks)
    pool.share(blocks[:1])
    assert pool.blocks[blocks[0]].ref_count == 2
    pool.free(blocks)
    assert pool.blocks[blocks[0]].ref_count == 1 and pool.num_free_blocks() == 3
    pool.free(blocks[:1])
    assert pool.num_free_blocks() == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks[:1])


def test_can_allocate_guards_allocate() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(RuntimeError, match="can_allocate"):
        pool.allocate(3)


def test_hashes_chain_the_parent_model_and_salt() -> None:
    tokens = list(range(12))
    hashes = hash_prefix_blocks(tokens, 4, "m", "")
    assert len(hashes) == 3
    assert hashes[1] == hash_block(hashes[0], tokens[4:8], "m", "")
    assert hashes[1] != hash_block(None, tokens[4:8], "m", "")  # same tokens, different prefix
    changed = hash_prefix_blocks([99, *tokens[1:]], 4, "m", "")
    assert all(a != b for a, b in zip(hashes, changed, strict=True))  # one early change alters all
    assert hash_prefix_blocks(tokens, 4, "m", "tenant-b")[0] != hashes[0]
    assert hash_prefix_blocks(tokens, 4, "other-model", "")[0] != hashes[0]
    assert len(hash_prefix_blocks(tokens[:7], 4, "m", "")) == 1  # only full blocks are hashed


def test_lookup_finds_registered_blocks_until_the_first_miss() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    hashes = hash_prefix_blocks(list(range(12)), 4, "m", "")
    blocks = pool.allocate(3)
    pool.register(blocks[0], hashes[0])
    pool.register(blocks[2], hashes[2])
    assert pool.lookup(hashes) == blocks[:1]  # block 1 not registered: the chain stops there
    assert pool.lookup(hash_prefix_blocks(list(range(12)), 4, "m", "salt")) == []


def test_unreferenced_cached_blocks_stay_findable_then_evict_lru() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)  # 3 usable blocks
    first, second = hash_prefix_blocks([1, 2], 2, "m", ""), hash_prefix_blocks([3, 4], 2, "m", "")
    a, b = pool.allocate(2)
    pool.register(a, first[0])
    pool.register(b, second[0])
    pool.free([a])  # freed first: least recently used
    pool.free([b])
    assert pool.num_free_blocks() == 3 and pool.lookup(first) == [a]
    pool.share([a])  # reuse revives it, and makes it the most recently used once freed again
    pool.free([a])
    (fresh,) = pool.allocate(1)  # the never-cached free block goes first
    assert fresh not in (a, b) and pool.lookup(first) == [a]
    (evicted,) = pool.allocate(1)
    assert evicted == b and pool.lookup(second) == [] and pool.lookup(first) == [a]
    assert pool.stats.num_evicted_blocks == 1
