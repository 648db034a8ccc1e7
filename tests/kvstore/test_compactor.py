"""Eviction, expiry and compaction, on a BlockStore in this process over a real Redis and real files."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import REGISTRY

from services.kvstore.blocks import BlockFound, BlockIn
from services.kvstore.compactor import Compactor
from services.kvstore.keys import BlockHash, Namespace
from services.kvstore.store import BlockStore, now_us
from tests.kvstore.conftest import RedisServer, raw_block, run_store

NAMESPACE = Namespace("tenant-a", "tiny-llama")
BLOCK_BYTES = 6000  # raw_block's payload; its record adds a header of about 200 B


def run(
    tmp_path: Path,
    redis_server: RedisServer,
    scenario: Callable[[BlockStore, Compactor], Awaitable[None]],
    **settings: object,
) -> None:
    """Runs `scenario` against a freshly opened store (no background maintenance: the test drives it)."""
    run_store(tmp_path, redis_server, lambda store: scenario(store, Compactor(store)), **settings)


def _compactions_timed() -> float:
    value = REGISTRY.get_sample_value(
        "thermocline_kvstore_operation_duration_seconds_count", {"operation": "compact"}
    )
    return value or 0.0


async def read_all(store: BlockStore, hashes: list[BlockHash]) -> dict[BlockHash, bytes]:
    """The payloads of the blocks that are served."""
    return {
        o.block_hash: o.record.payload
        async for o in store.get(NAMESPACE, hashes)
        if isinstance(o, BlockFound)
    }


def test_eviction_keeps_the_store_under_capacity_and_spares_recent_blocks(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    capacity = 8 * BLOCK_BYTES

    async def scenario(store: BlockStore, compactor: Compactor) -> None:
        recent = raw_block("read-often")
        await store.put(NAMESPACE, [recent])
        stored: list[BlockIn] = []
        for n in range(30):
            stored.append(raw_block(f"block-{n}"))
            await store.put(NAMESPACE, stored[-1:])
            assert await read_all(store, [recent.block_hash]) == {recent.block_hash: recent.payload}
            assert (await store.stats()).used_bytes <= capacity
        present = await store.lookup(NAMESPACE, [b.block_hash for b in stored])
        assert present == [b.block_hash for b in stored[-len(present) :]]  # the oldest went first
        assert 4 <= len(present) < 8 and store.counters.evicted_blocks == 30 - len(present)

    run(tmp_path, redis_server, scenario, capacity_bytes=capacity)


def test_compaction_reclaims_dead_space_and_keeps_every_live_block(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async def scenario(store: BlockStore, compactor: Compactor) -> None:
        blocks = [raw_block(f"block-{n}") for n in range(30)]  # two records fill an 8 KiB segment
        await store.put(NAMESPACE, blocks)
        live = [b for n, b in enumerate(blocks) if n % 3 == 0]
        dead = [b for n, b in enumerate(blocks) if n % 3 != 0]
        assert await store.delete(NAMESPACE, [b.block_hash for b in dead]) == len(dead)
        disk_before = (await store.stats()).disk_bytes
        hashes = [b.block_hash for b in blocks]
        timed_before = _compactions_timed()
        # reads run alongside the compactor and never miss
        result, *reads = await asyncio.gather(
            compactor.compact(), *[read_all(store, hashes) for _ in range(4)]
        )
        stats = await store.stats()
        assert result.num_segments >= 10 and stats.disk_bytes < disk_before / 2
        assert _compactions_timed() - timed_before == result.num_segments  # one duration per segment
        expected = {b.block_hash: b.payload for b in live}
        assert all(read == expected for read in reads)
        assert await read_all(store, hashes) == expected
        assert stats.used_bytes == sum(
            e.location.length
            for e in await store.index.get_many([store.key(NAMESPACE, h) for h in expected])
            if e
        )
        # the compacted segments still rebuild to the same index: moved records and needed tombstones
        await store.index.client.flushall()
        assert await read_all(store, hashes) == expected

    run(tmp_path, redis_server, scenario, max_segment_bytes=8192)


def test_compaction_during_a_long_put_leaves_its_unindexed_records_alone(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A put's records get their index entries only at its commit, after the last block: until then
    they look dead to the compactor, in segments that rotation has already sealed."""

    async def scenario(store: BlockStore, compactor: Compactor) -> None:
        blocks = [raw_block(f"block-{n}") for n in range(12)]  # two records fill an 8 KiB segment
        with store.writing() as put:
            for block in blocks:
                await store.append(put, NAMESPACE, block)
            assert store.writer.segment_id >= 5  # sealed segments hold the put's records
            result = await compactor.compact()  # the maintenance pass runs mid-put
            stored = await store.commit(put)
        assert result.num_segments == 0
        assert sorted(stored.stored) == sorted(b.block_hash for b in blocks)
        hashes = [b.block_hash for b in blocks]
        assert await read_all(store, hashes) == {b.block_hash: b.payload for b in blocks}
        # once the put has committed, its segments are ordinary ones again
        assert await store.delete(NAMESPACE, hashes[:10]) == 10
        assert (await compactor.compact()).num_segments >= 4

    run(tmp_path, redis_server, scenario, max_segment_bytes=8192)


def test_blocks_idle_past_the_ttl_expire(tmp_path: Path, redis_server: RedisServer) -> None:
    async def scenario(store: BlockStore, compactor: Compactor) -> None:
        blocks = [raw_block(f"block-{n}") for n in range(4)]
        await store.put(NAMESPACE, blocks)
        # the first two were last used two hours ago (the TTL is one)
        stale = now_us() - 2 * 3600 * 1_000_000
        for block in blocks[:2]:
            await store.index.touch([store.key(NAMESPACE, block.block_hash)], stale)
        assert await compactor.expire_idle() == 2
        assert await store.lookup(NAMESPACE, [b.block_hash for b in blocks]) == [
            b.block_hash for b in blocks[2:]
        ]
        assert store.counters.expired_blocks == 2

    run(tmp_path, redis_server, scenario, ttl_s=3600.0)


def test_a_touch_after_a_delete_leaves_no_entry_behind(tmp_path: Path, redis_server: RedisServer) -> None:
    """Locate and Get mark blocks used after they answer; a delete can land in between. The late
    touch must not bring back part of the entry (an orphan hash, or an LRU member eviction counts)."""

    async def scenario(store: BlockStore, compactor: Compactor) -> None:
        blocks = [raw_block(f"block-{n}") for n in range(3)]
        await store.put(NAMESPACE, blocks)
        keys = [store.key(NAMESPACE, b.block_hash) for b in blocks]
        assert await store.delete(NAMESPACE, [blocks[0].block_hash]) == 1
        await store.index.touch(keys, now_us())
        entries = await store.index.get_many(keys)
        assert entries[0] is None and all(e is not None for e in entries[1:])
        assert not await store.index.client.exists(store.index._entry_key(keys[0]))
        assert set(await store.index.least_recent(10)) == set(keys[1:])
        assert (await store.index.totals()).num_blocks == 2

    run(tmp_path, redis_server, scenario)


def test_a_tombstone_is_never_copied_after_a_put_of_its_key_in_flight(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A block deleted, then put again: a pass that compacts the tombstone's segment while that
    put is between its append and its commit must not copy the tombstone after the new record,
    or a rebuild (the last record of a key wins) drops the acknowledged block."""

    async def scenario(store: BlockStore, compactor: Compactor) -> None:
        block, filler = raw_block("put-again"), raw_block("filler")
        await store.put(NAMESPACE, [raw_block("oldest")])  # every record fills a 4 KiB segment
        await store.put(NAMESPACE, [block])
        assert await store.delete(NAMESPACE, [block.block_hash]) == 1
        await store.put(NAMESPACE, [filler])  # seals the tombstone's segment ...
        assert await store.delete(NAMESPACE, [filler.block_hash]) == 1  # ... and leaves it dead
        with store.writing() as put:
            await store.append(put, NAMESPACE, block)
            await compactor.compact()
            assert (await store.commit(put)).stored == [block.block_hash]
        await compactor.compact()  # once the put has committed, its tombstone is not needed
        assert await read_all(store, [block.block_hash]) == {block.block_hash: block.payload}
        await store.index.client.flushall()  # a rebuild from the segments keeps the block
        assert await read_all(store, [block.block_hash]) == {block.block_hash: block.payload}

    run(tmp_path, redis_server, scenario, max_segment_bytes=4096)
