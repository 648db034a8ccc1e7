"""The block store's puts, on a BlockStore in this process over a real Redis and real files."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.kvstore.blocks import BlockFound, BlockIn
from services.kvstore.keys import BlockHash, Namespace
from services.kvstore.segments import list_segments, scan_segment
from services.kvstore.store import BlockStore
from tests.kvstore.conftest import RedisServer, raw_block, run_store

NAMESPACE = Namespace("tenant-a", "tiny-llama")


async def served_payload(store: BlockStore, block_hash: BlockHash) -> bytes | None:
    """The payload a get serves for one block; None on a miss."""
    (outcome,) = [o async for o in store.get(NAMESPACE, [block_hash])]
    return outcome.record.payload if isinstance(outcome, BlockFound) else None


def records_of(store: BlockStore, block_hash: BlockHash) -> int:
    """How many records of the block the segments hold."""
    directory = store.config.segments_dir
    scans = [scan_segment(directory, segment_id) for segment_id in list_segments(directory)]
    return sum(found.record.block_hash == block_hash for scan in scans for found in scan.records)


def test_concurrent_puts_of_one_absent_block_write_one_record_that_a_rebuild_keeps(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Two puts of one hash with different bytes, neither stored yet: one stores it, the other
    is a duplicate and writes nothing, so a rebuild from the segments serves what the index did."""

    async def scenario(store: BlockStore) -> None:
        first = raw_block("one-hash")
        second = BlockIn(first.block_hash, first.codec, first.shape, first.payload[::-1])
        results = await asyncio.gather(store.put(NAMESPACE, [first]), store.put(NAMESPACE, [second]))
        assert sorted((r.stored, r.duplicates) for r in results) == [
            ([], [first.block_hash]),
            ([first.block_hash], []),
        ]
        winner = first if results[0].stored else second
        assert await served_payload(store, first.block_hash) == winner.payload
        assert records_of(store, first.block_hash) == 1
        await store.index.client.flushall()  # the next call rebuilds the index from the segments
        assert await served_payload(store, first.block_hash) == winner.payload
        assert store.counters.index_rebuilds == 2  # at open (empty Redis), and after the flush

    # the second put's index check lands inside the first one's fsync window, before its commit
    run_store(tmp_path, redis_server, scenario, fsync_batch_window_s=0.05)
